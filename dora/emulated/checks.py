"""C1-C3 and the accounting of a finished run, read from its run directory.

What must hold (docs/architecture.md, the three guarantees), and where it is read:
- accounting (`summary.json`): admitted = consumed + filtered + rolled back, nothing unassigned,
  and consumed = steps x B; the orchestrator held back no load (`held_back_loads`: its backstop
  against load ping-pong, which acts only where a planning rule missed a case);
- every step (the last `step` record of each step in `rollout.jsonl`: a step sent again after a
  roll-back counts once) holds exactly B groups, no group is in two steps, and every group's
  staleness is in [0, K] (C2, C3);
- the trainer trained every step on B groups and dropped no duplicate (`learn-metrics.jsonl`);
- C1, on every consumed group (`consumed.jsonl`, written by the emulated trainer): every sampled
  token was sampled by the group's version; in partial mode, where a trajectory may span
  versions, by the group's version or a newer one, never older (a sample interrupted before its
  first token resumes on the newer version, so a group's oldest token may be newer than the
  group: its staleness, counted from the group's version, is then an upper bound).

`check_run` returns the problems found (empty when the run is sound); it never raises on a
sound run directory. `check_accounting` checks all but C1, so it holds for a run of any trainer
(the chaos tests read real runs with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dora.records import (
    Consumed,
    Step,
    read_consumed,
    read_records,
    read_summary,
    read_trainer_steps,
)

__all__ = ["RunCheck", "check_accounting", "check_run"]


@dataclass(frozen=True, kw_only=True)
class RunCheck:
    """What was checked and what failed."""

    groups_checked: int
    problems: list[str]
    extra: dict[str, int]
    """Serve's counters from `summary.json` (empty when it is missing)."""

    @property
    def ok(self) -> bool:
        return not self.problems


def check_accounting(run_dir: Path, *, steps: int, batch_size: int, staleness: int) -> RunCheck:
    """The accounting, the steps and the trainer's record of any finished run (everything of the
    module docstring but C1, which needs the emulated trainer's `consumed.jsonl`)."""
    problems, version_of, extra = _accounting(run_dir, steps, batch_size, staleness)
    return RunCheck(groups_checked=len(version_of), problems=problems[:50], extra=extra)


def check_run(
    run_dir: Path, *, steps: int, batch_size: int, staleness: int, spans_versions: bool = False
) -> RunCheck:
    """Check the run in `run_dir` (see the module docstring); `spans_versions` for partial."""
    problems, version_of, extra = _accounting(run_dir, steps, batch_size, staleness)
    if extra:
        problems += _c1(run_dir, version_of, spans_versions)
    return RunCheck(groups_checked=len(version_of), problems=problems[:50], extra=extra)


def _accounting(
    run_dir: Path, steps: int, batch_size: int, staleness: int
) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """(problems, the version of each group trained, serve's counters)."""
    problems: list[str] = []
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return [f"{summary_path}: missing (run unfinished?)"], {}, {}
    summary = read_summary(summary_path)
    if summary is None:
        return [f"{summary_path}: does not decode"], {}, {}
    extra = {k: int(v) for k, v in summary.extra.items()}
    if extra["unassigned"] != 0:
        problems.append(f"{extra['unassigned']} admitted groups left unassigned")
    if extra["admitted"] != extra["consumed"] + extra["filtered"] + extra["rolled_back"]:
        problems.append(
            f"admitted {extra['admitted']} != consumed {extra['consumed']} + filtered "
            f"{extra['filtered']} + rolled back {extra['rolled_back']}"
        )
    if extra.get("held_back_loads", 0):
        problems.append(
            f"the orchestrator held back {extra['held_back_loads']} loads (a rule missed a case)"
        )
    if extra["consumed"] != steps * batch_size:
        problems.append(f"consumed {extra['consumed']} groups, expected {steps} x {batch_size}")

    step_groups: dict[int, list[str]] = {}
    step_versions: dict[int, list[int]] = {}
    for r in read_records(run_dir / "rollout.jsonl", kinds={"step"}):
        assert isinstance(r, Step)
        step_groups[r.step] = r.groups
        step_versions[r.step] = r.versions
    if sorted(step_groups) != list(range(steps)):
        problems.append(f"steps sent {sorted(step_groups)}, expected 0..{steps - 1}")
    version_of: dict[str, int] = {}
    for step, groups in step_groups.items():
        if len(groups) != batch_size:
            problems.append(f"step {step} holds {len(groups)} groups, expected {batch_size}")
        for gid, v in zip(groups, step_versions[step], strict=True):
            if gid in version_of:
                problems.append(f"group {gid} is in two steps")
            version_of[gid] = v
            if not 0 <= step - v <= staleness:
                problems.append(
                    f"group {gid} of version {v} in step {step}: staleness > {staleness}"
                )

    trained = {r.step: r.metrics for r in read_trainer_steps(run_dir / "learn-metrics.jsonl")}
    for step in range(steps):
        rec = trained.get(step)
        if rec is None:
            problems.append(f"the trainer has no record of step {step}")
        elif rec["groups"] != batch_size or rec["duplicate_groups"] != 0:
            problems.append(
                f"the trainer trained step {step} on {rec['groups']:g} groups "
                f"({rec['duplicate_groups']:g} duplicates)"
            )
    return problems, version_of, extra


def _c1(run_dir: Path, version_of: dict[str, int], spans_versions: bool) -> list[str]:
    """C1 on the last consumption of each group (a resumed trainer consumes a step again)."""
    problems: list[str] = []
    consumed: dict[str, Consumed] = {r.group: r for r in read_consumed(run_dir / "consumed.jsonl")}
    for gid, v in version_of.items():
        got = consumed.get(gid)
        if got is None:
            problems.append(f"group {gid} was never consumed by the trainer")
            continue
        if got.version != v:
            problems.append(f"group {gid}: the trainer got version {got.version}, serve sent {v}")
        tokens = got.token_versions
        if spans_versions:
            if tokens and min(tokens) < v:
                problems.append(f"group {gid} of version {v} holds tokens of {min(tokens)}")
        elif tokens and tokens != [v]:
            problems.append(f"C1: group {gid} of version {v} holds tokens of versions {tokens}")
    return problems
