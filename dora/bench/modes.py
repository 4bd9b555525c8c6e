"""`dora bench modes CONFIG`: sync, one-step-off, partial and dora on one workload, back to back.

Each mode is a real run of the config (same model, tasks, seeds and steps; only `rollout.mode`
differs), launched the way `dora run` launches one: the initial model prepared once, then
`python -m dora.cli serve` and `python -m dora.cli learn` with the same overrides, a free port and a
run directory of their own (`OUT/<mode>`). The benchmark then reads the run directories.

Where the cores go, stated in the table's `cores` column (dora/placement.py): every mode gets
every core. `sync` is colocated, as the paper's synchronous baseline; `one_step_off`, `partial`
and `dora` share the cores unpinned (`--placement shared`, the default) or, with `--placement
split`, are pinned to a fixed split as separate GPU pools would be; `sync_split` (on request) is
sync on that split.
Every mode uses the same engine, the same fast paths and the same config otherwise. Every process
runs with `OMP_WAIT_POLICY=PASSIVE` (unless the caller set it): on a shared machine, a trainer with
two OpenMP threads spins at every barrier while its peer thread is descheduled, which made colocated
sync's trainer 10x slower in our measurement; one-thread processes are unaffected, so this only
keeps the colocated baseline from being weakened.

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

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from dora.bench import summary
from dora.bench.proc import TrainedCounter, cpu_model, own_cpu_s, tree_cpu_s
from dora.bench.rounds import round_bound_line, round_bound_shares, round_ratio_lines
from dora.launch import free_port, sigterm_interrupts, start_side, stop_all
from dora.placement import KINDS, Kind, Placement, place
from dora.report import RunData, load_run

__all__ = [
    "ModeResult",
    "Placement",
    "bound_lines",
    "machine_bound",
    "main",
    "median_run",
    "plan",
    "plot_modes",
    "profile_table",
    "ratio_lines",
    "summarise",
    "table",
]

MODES = ("sync", "one_step_off", "partial", "dora")
KNOWN = (*MODES, "sync_split")
POLL_S = 0.2


def plan(
    modes: list[str],
    cores: list[int],
    *,
    instances: int,
    trainer_cores: int,
    placement: str = "shared",
    sync_trainer_threads: int | None = None,
    trainer_threads: int | None = None,
) -> list[Placement]:
    """The placement of each mode on `cores` (pure): sync colocated, `sync_split` split, the
    asynchronous modes `placement` ("shared" or "split")."""
    if placement not in KINDS:
        raise ValueError(f"unknown placement {placement!r}; choose from {', '.join(KINDS)}")
    out = []
    for name in modes:
        if name not in KNOWN:
            raise ValueError(f"unknown mode {name!r}; choose from {', '.join(KNOWN)}")
        mode = "sync" if name == "sync_split" else name
        kind: Kind = (
            "split" if name == "sync_split" else "colocated" if name == "sync" else placement  # type: ignore[assignment]
        )
        threads = sync_trainer_threads if name == "sync" else trainer_threads
        out.append(
            place(
                name,
                mode,
                cores,
                instances=instances,
                kind=kind,
                trainer_cores=trainer_cores,
                trainer_threads=threads,
            )
        )
    return out


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
    return _render(rows)


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
    return _render(rows)


def _cores_used(r: ModeResult) -> str:
    if r.serve_cores_used is None or r.learn_cores_used is None:
        return "-"
    return f"{r.serve_cores_used:.2f}/{r.learn_cores_used:.2f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.3f}"


def _render(rows: Sequence[tuple[str, ...]]) -> str:
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
    order = [m for m in ("one_step_off", "partial", "sync_split", "sync") if m in by]
    return [
        f"dora/{m} throughput ratio: {dora / by[m].tokens_per_s:.2f}"
        for m in order
        if by[m].tokens_per_s > 0
    ]


# --- launching one run ---------------------------------------------------------------------------


def run_mode(
    config_path: str,
    overrides: list[str],
    run_dir: Path,
    placement: Placement,
    *,
    steps: int,
    warmup: int = 0,
) -> int:
    """Run one mode to the end; write `bench-cpu.json` beside its records (CPU from the end of
    trained step `warmup` on, as `summarise` measures). Returns the exit code."""
    from dora.config import load_config
    from dora.config_text import render_toml
    from dora.models.prepare import prepare_model

    run_dir.mkdir(parents=True, exist_ok=True)
    settings = [
        *overrides,
        f"rollout.mode={placement.mode}",
        f"serve.threads_per_instance={placement.instance_threads}",
        f"learn.threads={placement.trainer_threads}",
        "log.progress=false",
    ]
    config = load_config(config_path, settings)
    model_dir = prepare_model(config)
    port = free_port(config.serve.host)
    settings += [
        f"serve.port={port}",
        f"log.run_dir={run_dir}",
        f"model.path={model_dir}",
        "model.warmup_steps=0",
    ]
    (run_dir / "config.toml").write_text(render_toml(load_config(config_path, settings)))
    env = {
        "OMP_WAIT_POLICY": "PASSIVE",  # see the module docstring; a user's own setting wins
        **os.environ,
        "DORA_SERVE_ADDRESS": f"tcp://{config.serve.host}:{port}",
    }
    cli = [sys.executable, "-m", "dora.cli"]

    def pinned(cores: list[int]) -> list[str]:
        return ["taskset", "-c", ",".join(map(str, cores))] if placement.pinned else []

    counter = TrainedCounter(run_dir / "rollout.jsonl")
    sides = (("serve", placement.serve_cores), ("learn", placement.trainer_cores))
    with contextlib.ExitStack() as stack:
        stack.enter_context(sigterm_interrupts())  # so that a stopped benchmark stops its sides
        procs: dict[str, subprocess.Popen[bytes]] = {}
        # dora run's own stop (SIGINT, SIGTERM, SIGKILL, by process group), however this ends
        stack.callback(stop_all, procs)
        for side, cores in sides:
            log = stack.enter_context(open(run_dir / f"{side}.log", "ab"))
            procs[side] = start_side(
                [*pinned(cores), *cli, side, config_path, *settings],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        at_first: dict[str, float] | None = None
        at_last: dict[str, float] | None = None
        loads = []
        last_cpu: dict[str, float] | None = None
        while any(p.poll() is None for p in procs.values()):
            if any(p.returncode not in (None, 0) for p in procs.values()):
                break
            cpu = {side: tree_cpu_s([p.pid]) for side, p in procs.items()}
            cpu["serve_self"] = own_cpu_s(procs["serve"].pid)
            last_cpu = cpu
            n = counter.poll()
            if n >= 1 + warmup and at_first is None:
                at_first = cpu
            if n >= steps and at_last is None:
                at_last = cpu
            if at_first is not None and at_last is None:
                loads.append(os.getloadavg()[0])
            time.sleep(POLL_S)
    if at_last is None and counter.poll() >= steps:
        at_last = last_cpu  # the run ended within one poll of its last step: the last sample
    record: dict[str, float] = {}
    if at_first is not None and at_last is not None:
        for side in (*procs, "serve_self"):
            record[f"{side}_cpu_s"] = at_last[side] - at_first[side]
        record["window_cpu_s"] = record["serve_cpu_s"] + record["learn_cpu_s"]
    if loads:
        record["load_avg"] = sum(loads) / len(loads)
    (run_dir / "bench-cpu.json").write_text(json.dumps(record))
    codes = [p.returncode for p in procs.values()]
    return next((c for c in codes if c), 0)


# --- the command ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dora bench modes", description=summary(__doc__))
    p.add_argument("config", help="config file, e.g. examples/math/bench.toml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated from {KNOWN}")
    p.add_argument("--steps", type=int, default=None, help="learn.steps (default: the config's)")
    p.add_argument("--out", default=None, help="output folder (default runs/bench-modes-<time>)")
    p.add_argument(
        "--placement",
        choices=KINDS,
        default="shared",
        help="the asynchronous modes: share every core unpinned (default) or a fixed split",
    )
    p.add_argument("--trainer-cores", type=int, default=None, help="split: trainer's cores")
    p.add_argument(
        "--trainer-threads",
        type=int,
        default=None,
        help="the asynchronous modes' trainer threads (default: dora.placement's rule)",
    )
    p.add_argument(
        "--sync-trainer-threads",
        type=int,
        default=None,
        help="colocated sync: the trainer's threads (default: every core)",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per mode, interleaved; the median is shown"
    )
    p.add_argument("--reuse", action="store_true", help="only summarise the run dirs in --out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    from dora.config import load_config

    overrides = list(args.overrides) + ([f"learn.steps={args.steps}"] if args.steps else [])
    config = load_config(args.config, overrides)
    cores = sorted(os.sched_getaffinity(0))
    placements = plan(
        [m.strip() for m in args.modes.split(",") if m.strip()],
        cores,
        instances=config.serve.instances,
        trainer_cores=args.trainer_cores or max(1, len(cores) // 2),
        placement=args.placement,
        sync_trainer_threads=args.sync_trainer_threads,
        trainer_threads=args.trainer_threads,
    )
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"runs/bench-modes-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    runs: dict[str, list[ModeResult]] = {pl.name: [] for pl in placements}
    for rep in range(args.repeats):  # round robin, so that a burst of load hits every mode alike
        for pl in placements:
            run_dir = out / (pl.name if args.repeats == 1 else f"{pl.name}-{rep}")
            if not args.reuse:
                t0 = time.monotonic()
                code = run_mode(args.config, overrides, run_dir, pl, steps=config.learn.steps)
                took = time.monotonic() - t0
                print(f"{pl.name}: exit {code} in {took:.0f} s ({run_dir})", flush=True)
                if code:
                    print(f"dora bench modes: {pl.name} failed; see {run_dir}", file=sys.stderr)
                    return 1
            runs[pl.name].append(summarise(run_dir, name=pl.name, placement=pl.describe()))
    results = [median_run(r) for r in runs.values()]
    loads = [r.load_avg for r in results if r.load_avg is not None]
    print()
    print(
        f"{config.serve.instances} instances, B={config.rollout.batch_size} "
        f"G={config.rollout.group_size} K={config.rollout.staleness} (dora, partial), "
        f"{config.learn.steps} steps; {len(cores)} cores; load average during the runs "
        + (f"{min(loads):.1f}-{max(loads):.1f}" if loads else "unknown")
    )
    print(table(results))
    print("\nwhere the time goes (trainer waits: share of its step spent waiting for groups)")
    print(profile_table(results))
    if args.repeats > 1:
        print("(the run with the median tokens/s of each mode; all runs, tokens/s, and dora's")
        print(" ratio over each baseline within each round, where the host's speed is alike:)")
        for name, rs in runs.items():
            print(f"  {name}: " + ", ".join(f"{r.tokens_per_s:.0f}" for r in rs))
        for line in round_ratio_lines(runs):
            print(line)
    bound = machine_bound([r for rs in runs.values() for r in rs], len(cores))
    print()
    for line in bound_lines(results, bound):
        print(line)
    if args.repeats > 1:
        for line in round_bound_line(runs, len(cores)):
            print(line)
    picture = plot_modes(results, out / "modes.png")
    print(f"\ntimelines of these runs, side by side: {picture}")
    ratios = ratio_lines(results)
    (out / "bench-modes.json").write_text(
        json.dumps(
            {
                "command": " ".join(["dora bench modes", *(argv or sys.argv[1:])]),
                "date": started,
                "machine": {
                    "cores": cores,
                    "cpu": cpu_model(),
                    "python": platform.python_version(),
                },
                "placements": [asdict(p) for p in placements],
                "results": [asdict(r) for r in results],
                "runs": {name: [asdict(r) for r in rs] for name, rs in runs.items()},
                "ratios": ratios,
                "bound_tokens_per_s": bound[0] if bound else None,
                "dora_round_bound_shares": round_bound_shares(runs, len(cores)),
            },
            indent=2,
        )
    )
    print()
    for line in ratios:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
