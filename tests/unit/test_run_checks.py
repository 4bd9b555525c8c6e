"""The run-directory checks (dora/emulated/checks.py) on small hand-written run directories:
`check_accounting` holds for a sound run of any trainer (no `consumed.jsonl`), and names what is
wrong in one that is not; `check_run` adds C1, which needs the emulated trainer's record."""

from __future__ import annotations

from pathlib import Path

import msgspec

from dora.emulated.checks import check_accounting, check_run
from dora.records import Consumed, Step, TrainerStep, write_summary, write_trainer_step
from tests.unit.bench.fixtures import summary_record

STEPS, B, K = 3, 2, 1


def _write(
    run_dir: Path,
    *,
    steps: list[tuple[list[str], list[int]]],
    consumed: bool,
    held_back_loads: int = 0,
) -> None:
    """A run directory as serve and the trainers write it (their record structs)."""
    admitted = sum(len(g) for g, _ in steps)
    extra = {"unassigned": 0, "admitted": admitted, "consumed": admitted, "filtered": 0}
    extra |= {"rolled_back": 0, "held_back_loads": held_back_loads}
    write_summary(run_dir / "summary.json", summary_record(steps=len(steps), extra=extra))
    rollout = [
        Step(step=s, groups=g, versions=v, staleness=[s - x for x in v], fill_s=0.1)
        for s, (g, v) in enumerate(steps)
    ]
    (run_dir / "rollout.jsonl").write_bytes(
        b"".join(msgspec.json.encode(r) + b"\n" for r in rollout)
    )
    for s, (g, _) in enumerate(steps):
        metrics = {"groups": float(len(g)), "duplicate_groups": 0.0}
        write_trainer_step(
            run_dir / "learn-metrics.jsonl", TrainerStep(step=s, time=0.0, metrics=metrics)
        )
    if consumed:
        rows = [
            Consumed(step=s, group=gid, version=v, incarnation=0, samples=2, masked=0,
                     token_versions=[v])
            for s, (groups, versions) in enumerate(steps)
            for gid, v in zip(groups, versions, strict=True)
        ]  # fmt: skip
        (run_dir / "consumed.jsonl").write_bytes(
            b"".join(msgspec.json.encode(r) + b"\n" for r in rows)
        )


SOUND = [(["a", "b"], [0, 0]), (["c", "d"], [0, 1]), (["e", "f"], [1, 2])]


def test_a_sound_run_passes_both_checks(tmp_path: Path) -> None:
    _write(tmp_path, steps=SOUND, consumed=True)
    accounting = check_accounting(tmp_path, steps=STEPS, batch_size=B, staleness=K)
    assert accounting.ok and accounting.groups_checked == 6 and accounting.extra["consumed"] == 6
    assert check_run(tmp_path, steps=STEPS, batch_size=B, staleness=K).ok


def test_accounting_needs_no_record_of_the_emulated_trainer(tmp_path: Path) -> None:
    _write(tmp_path, steps=SOUND, consumed=False)
    assert check_accounting(tmp_path, steps=STEPS, batch_size=B, staleness=K).ok
    problems = check_run(tmp_path, steps=STEPS, batch_size=B, staleness=K).problems
    assert any("never consumed" in p for p in problems)


def test_accounting_names_a_group_in_two_steps_and_a_stale_one(tmp_path: Path) -> None:
    _write(tmp_path, steps=[(["a", "b"], [0, 0]), (["b", "d"], [0, 1]), (["e", "f"], [0, 2])],
           consumed=False)  # fmt: skip
    problems = check_accounting(tmp_path, steps=STEPS, batch_size=B, staleness=K).problems
    assert "group b is in two steps" in problems
    assert "group e of version 0 in step 2: staleness > 1" in problems


def test_an_unfinished_run_says_so(tmp_path: Path) -> None:
    check = check_accounting(tmp_path, steps=STEPS, batch_size=B, staleness=K)
    assert not check.ok and "missing" in check.problems[0] and check.extra == {}


def test_a_load_the_orchestrator_held_back_is_a_problem(tmp_path: Path) -> None:
    _write(tmp_path, steps=SOUND, consumed=False, held_back_loads=2)
    problems = check_accounting(tmp_path, steps=STEPS, batch_size=B, staleness=K).problems
    assert problems == ["the orchestrator held back 2 loads (a rule missed a case)"]
