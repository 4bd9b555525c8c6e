"""What `dora bench modes` reports from the run directories it leaves: each mode's numbers
(`ModeResult`, read by `summarise`, pure over the files), the tables, the machine's bound, the
ratio lines and the stacked timelines. `dora bench cluster` reports its runs with the same.

What is measured, all over the steady part of the run: from the `trained` record of step 0 to
that of the last step (serve's clock), so process start-up and the first fill are left out of every
mode alike. Trained tokens are the trainer's loss tokens of steps 1..T-1. CPU-seconds are those of
every process of the run (utime + stime, reaped children included, from /proc), sampled every
`POLL_S` and read at the two ends of that window. The runs' instance x time timelines are drawn
stacked in `OUT/modes.png`. The machine's bound is the trained tokens/s the machine would give if
every core were busy at the best CPU cost per trained token measured in this benchmark (the lowest
CPU-seconds per token of any run of any mode): `cores / best CPU-s per token`; each mode's
tokens/s is printed as a share of it. With `--repeats N` (round robin), the table shows each
mode's median run, then every run's tokens/s and dora's ratio over each baseline within each
round, and dora's share of each round's own bound (dora.bench.rounds). The last line is
`dora/sync throughput ratio: X.XX`, the medians'.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dora.bench.proc import POLL_S
from dora.report import RunData, load_run

__all__ = [
    "ModeResult",
    "bound_lines",
    "machine_bound",
    "median_run",
    "plot_modes",
    "profile_table",
    "ratio_lines",
    "render",
    "summarise",
    "table",
]


# --- measuring one run ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class ModeResult:
    """One mode's numbers (steady window: trained step 0 to trained step T-1)."""

    name: str
    placement: str
    steps: int
    tokens: float
    window_s: float
    tokens_per_s: float
    cpu_s: float | None
    cpu_s_per_token: float | None
    step_s: float
    rollout_only_share: float
    instance_util: float
    trainer_idle_share: float
    staleness_mean: float
    staleness_max: int
    max_versions_serving: int
    reward_first: float
    reward_last: float
    load_avg: float | None = None
    serve_cores_used: float | None = None
    """CPU-seconds of serve and its instances per second of the window (cores kept busy)."""
    learn_cores_used: float | None = None
    serve_cpu_s_per_token: float | None = None
    """Serve's and its instances' CPU-seconds per trained (= generated, single-turn) token."""
    learn_cpu_s_per_token: float | None = None
    """The trainer's CPU-seconds per trained token."""
    serve_self_cpu_s_per_token: float | None = None
    """The `dora serve` process alone (dispatcher, router, HTTP, episodes), without instances."""
    busy_instances: float = 0.0
    """Instances with calls in flight, averaged over the window's ticks."""
    run_dir: str = ""
    calls_per_busy_instance: float = 0.0
    """Calls in flight on an instance that has any (the engine's batch, roughly): the median over
    the busy instances of the window's ticks (the mean is pulled up by the burst of new groups at
    each step's start). On shared cores every busy instance pays its own decode step, so few
    calls each is what makes a token expensive."""


def summarise(run_dir: Path, *, name: str, placement: str, warmup: int = 0) -> ModeResult:
    """The numbers of a finished run directory (pure over its files), measured from the end of
    trained step `warmup` to the end of the last."""
    run = load_run(run_dir)
    return _summarise(run, name=name, placement=placement, cpu=_read_cpu(run_dir), warmup=warmup)


def _read_cpu(run_dir: Path) -> dict[str, float]:
    path = run_dir / "bench-cpu.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _summarise(
    run: RunData, *, name: str, placement: str, cpu: dict[str, float], warmup: int = 0
) -> ModeResult:
    trained = sorted(run.trained, key=lambda r: r.step)[warmup:]
    if len(trained) < 2:
        msg = f"{run.run_dir}: fewer than 2 trained steps after a warm-up of {warmup}"
        raise ValueError(msg)
    first, last = trained[0], trained[-1]
    window = last.time_s - first.time_s
    later = [r.numbers() for r in trained[1:]]
    tokens = sum(m["tokens"] for m in later)
    step_time = sum(m["step_time_s"] for m in later)
    wait = sum(m["wait_s"] for m in later)
    train = sum(m["train_s"] for m in later)
    ticks = [tick for tick in run.ticks if first.time_s < tick.time_s <= last.time_s]
    utils = [inst.util for tick in ticks for inst in tick.instances]
    busy = [n for tick in ticks for inst in tick.instances if (n := inst.inflight) > 0]
    staleness = [s for rec in run.steps if rec.step >= trained[0].step for s in rec.staleness]
    cpu_s = cpu.get("window_cpu_s")
    rewards = [r.numbers()["reward_mean"] for r in trained]
    k = max(1, len(rewards) // 4)
    return ModeResult(
        name=name,
        placement=placement,
        steps=len(trained),
        tokens=tokens,
        window_s=window,
        tokens_per_s=tokens / window if window > 0 else 0.0,
        cpu_s=cpu_s,
        # a window inside one CPU sample (POLL_S) measured nothing: not a free token
        cpu_s_per_token=cpu_s / tokens if cpu_s and tokens else None,
        step_s=window / len(later),
        rollout_only_share=wait / step_time if step_time else 0.0,
        instance_util=sum(utils) / len(utils) if utils else 0.0,
        trainer_idle_share=max(0.0, 1.0 - train / window) if window > 0 else 0.0,
        staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
        staleness_max=max(staleness, default=0),
        max_versions_serving=run.summary.max_versions_serving if run.summary else 0,
        reward_first=sum(rewards[:k]) / k,
        reward_last=sum(rewards[-k:]) / k,
        load_avg=cpu.get("load_avg"),
        serve_cores_used=cpu["serve_cpu_s"] / window if "serve_cpu_s" in cpu and window else None,
        learn_cores_used=cpu["learn_cpu_s"] / window if "learn_cpu_s" in cpu and window else None,
        serve_cpu_s_per_token=cpu["serve_cpu_s"] / tokens
        if "serve_cpu_s" in cpu and tokens
        else None,
        learn_cpu_s_per_token=cpu["learn_cpu_s"] / tokens
        if "learn_cpu_s" in cpu and tokens
        else None,
        serve_self_cpu_s_per_token=(
            cpu["serve_self_cpu_s"] / tokens if "serve_self_cpu_s" in cpu and tokens else None
        ),
        run_dir=str(run.run_dir),
        busy_instances=len(busy) / len(ticks) if ticks else 0.0,
        calls_per_busy_instance=statistics.median(busy) if busy else 0.0,
    )


def median_run(runs: list[ModeResult]) -> ModeResult:
    """The run with the median tokens/s (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r.tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


def table(results: list[ModeResult]) -> str:
    """The comparison table, one row per mode (plain text, fixed width)."""
    head = (
        "mode",
        "cores",
        "tokens/s",
        "tok/step",
        "CPU-s/1k tok",
        "cores used s/l",
        "step s",
        "rollout-only",
        "inst util",
        "trainer idle",
        "staleness",
        "versions",
    )
    rows = [head]
    for r in results:
        cpu = f"{1000 * r.cpu_s_per_token:.2f}" if r.cpu_s_per_token is not None else "-"
        rows.append(
            (
                r.name,
                r.placement,
                f"{r.tokens_per_s:.1f}",
                f"{r.tokens / max(1, r.steps - 1):.0f}",
                cpu,
                _cores_used(r),
                f"{r.step_s:.2f}",
                f"{100 * r.rollout_only_share:.0f}%",
                f"{100 * r.instance_util:.0f}%",
                f"{100 * r.trainer_idle_share:.0f}%",
                f"{r.staleness_mean:.2f} (max {r.staleness_max})",
                str(r.max_versions_serving),
            )
        )
    return render(rows)


def profile_table(results: list[ModeResult]) -> str:
    """Where the time goes, per mode: CPU per token on each side, and who waits for whom."""
    head = (
        "mode",
        "serve CPU-ms/tok",
        "of it serve proc",
        "learn CPU-ms/tok",
        "busy inst",
        "calls/busy inst",
        "trainer busy",
        "trainer waits",
        "cores used s/l",
    )
    rows = [head]
    for r in results:
        rows.append(
            (
                r.name,
                _ms(r.serve_cpu_s_per_token),
                _ms(r.serve_self_cpu_s_per_token),
                _ms(r.learn_cpu_s_per_token),
                f"{r.busy_instances:.2f}",
                f"{r.calls_per_busy_instance:.1f}",
                f"{100 * (1 - r.trainer_idle_share):.0f}%",
                f"{100 * r.rollout_only_share:.0f}%",
                _cores_used(r),
            )
        )
    return render(rows)


def _cores_used(r: ModeResult) -> str:
    if r.serve_cores_used is None or r.learn_cores_used is None:
        return "-"
    return f"{r.serve_cores_used:.2f}/{r.learn_cores_used:.2f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.3f}"


def render(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_modes(results: list[ModeResult], path: Path) -> Path:
    """The instance x time timeline of each mode's run, stacked, over the same number of seconds
    (the shortest steady window) from each run's first trained step."""
    from dora.report import plot_timelines

    seconds = min(r.window_s for r in results)
    panels = [
        (
            f"{r.name} ({r.placement}): {r.tokens_per_s:.0f} tokens/s, "
            f"{r.max_versions_serving} version(s) at once",
            load_run(Path(r.run_dir)),
        )
        for r in results
    ]
    plot_timelines(panels, path, seconds=seconds)
    return path


def machine_bound(runs: list[ModeResult], cores: int) -> tuple[float, ModeResult] | None:
    """Trained tokens/s if all `cores` were busy at the best CPU cost per trained token measured
    among `runs` (every mode's, every repeat's), and the run that measured it."""
    measured = [r for r in runs if r.cpu_s_per_token]
    if not measured:
        return None
    best = min(measured, key=lambda r: r.cpu_s_per_token or 0.0)
    return cores / (best.cpu_s_per_token or 1.0), best


def bound_lines(results: list[ModeResult], bound: tuple[float, ModeResult] | None) -> list[str]:
    """The bound, where it comes from, and each mode's tokens/s as a share of it."""
    if bound is None:
        return [
            f"machine bound: not measured (no run's steady window spanned a CPU sample, every "
            f"{POLL_S:g} s: run more steps)"
        ]
    tokens_per_s, best = bound
    lines = [
        f"machine bound: {tokens_per_s:.0f} trained tokens/s (every core busy at "
        f"{1000 * (best.cpu_s_per_token or 0.0):.3f} CPU-ms per trained token, the best measured: "
        f"{best.name}, {Path(best.run_dir).name})"
    ]
    lines += [
        f"  {r.name}: {r.tokens_per_s:.0f} tokens/s, {100 * r.tokens_per_s / tokens_per_s:.0f}% "
        "of the bound"
        for r in results
    ]
    return lines


def ratio_lines(results: list[ModeResult]) -> list[str]:
    """dora's throughput over each baseline's; `dora/sync` (colocated) last."""
    by = {r.name: r for r in results}
    if "dora" not in by:
        return []
    dora = by["dora"].tokens_per_s
    order = [m for m in ("inflight", "one_step_off", "partial", "sync_split", "sync") if m in by]
    return [
        f"dora/{m} throughput ratio: {dora / by[m].tokens_per_s:.2f}"
        for m in order
        if by[m].tokens_per_s > 0
    ]
