"""`dora bench modes CONFIG`: sync, one-step-off, partial and dora on one workload, back to back.

Each mode is a real run of the config (same model, tasks, seeds and steps; only `rollout.mode`
differs), launched the way `dora run` launches one: the initial model prepared once, then
`python -m dora.cli serve` and `python -m dora.cli learn` with the same overrides, a free port and a
run directory of their own (`OUT/<mode>`). The benchmark then reads the run directories.

Where the cores go, stated in the table's `cores` column (dora/cpu_plan.py): every mode gets
every core. `sync` is colocated, as the paper's synchronous baseline; `one_step_off`, `partial`
and `dora` share the cores unpinned (`--placement shared`, the default) or, with `--placement
split`, are pinned to a fixed split as separate GPU pools would be; `sync_split` (on request) is
sync on that split, and `inflight` (on request) is dora's scheduler with every new version loaded
under the running requests, placed as dora is.
Every mode uses the same engine, the same fast paths and the same config otherwise. Every process
runs with `OMP_WAIT_POLICY=PASSIVE` (unless the caller set it): on a shared machine, a trainer with
two OpenMP threads spins at every barrier while its peer thread is descheduled, which made colocated
sync's trainer 10x slower in our measurement; one-thread processes are unaffected, so this only
keeps the colocated baseline from being weakened.

What is measured, and how the table reads, is in dora/bench/modes_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from dora.bench import summary
from dora.bench.modes_report import (
    ModeResult,
    bound_lines,
    machine_bound,
    median_run,
    plot_modes,
    profile_table,
    ratio_lines,
    summarise,
    table,
)
from dora.bench.proc import POLL_S, TrainedCounter, cpu_model, own_cpu_s, tree_cpu_s
from dora.bench.rounds import round_bound_line, round_bound_shares, round_ratio_lines
from dora.cpu_plan import KINDS, CorePlan, Kind, place
from dora.launch import free_port, sigterm_interrupts, start_side, stop_all

__all__ = ["CorePlan", "main", "plan", "run_mode"]

MODES = ("sync", "one_step_off", "partial", "dora")
KNOWN = (*MODES, "inflight", "sync_split")


def plan(
    modes: list[str],
    cores: list[int],
    *,
    instances: int,
    trainer_cores: int,
    placement: str = "shared",
    sync_trainer_threads: int | None = None,
    trainer_threads: int | None = None,
) -> list[CorePlan]:
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


# --- launching one run ---------------------------------------------------------------------------


def run_mode(
    config_path: str,
    overrides: list[str],
    run_dir: Path,
    placement: CorePlan,
    *,
    steps: int,
    warmup: int = 0,
) -> int:
    """Run one mode to the end; write `bench-cpu.json` beside its records (CPU from the end of
    trained step `warmup` on, as `summarise` measures). Returns the exit code."""
    run_dir.mkdir(parents=True, exist_ok=True)
    settings, env = _run_settings(config_path, overrides, run_dir, placement)
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
        window = _Window(counter, first=1 + warmup, last=steps)
        while not sides_ended(procs.values()):
            window.sample(procs)
            time.sleep(POLL_S)
        failed = first_failure(procs)  # before the other side is stopped
    (run_dir / "bench-cpu.json").write_text(json.dumps(window.record(procs)))
    if failed is not None:
        side, code = failed
        print(f"dora {side} exited {code}: see {run_dir / f'{side}.log'}", file=sys.stderr)
        return code
    codes = [p.returncode for p in procs.values()]
    return next((c for c in codes if c), 0)


def sides_ended(procs: Iterable[subprocess.Popen[bytes]]) -> bool:
    """Whether a run's sides are done: all exited, or one failed (the others are then stopped).
    Every process is polled: a side that failed at start (`dora learn` refusing a run directory)
    is seen while the other still runs."""
    codes = [p.poll() for p in procs]
    return all(c is not None for c in codes) or any(c not in (None, 0) for c in codes)


def first_failure(procs: Mapping[str, subprocess.Popen[bytes]]) -> tuple[str, int] | None:
    """The side that exited with an error on its own, and its code (None if none did)."""
    return next(((side, p.returncode) for side, p in procs.items() if p.returncode), None)


def _run_settings(
    config_path: str, overrides: list[str], run_dir: Path, placement: CorePlan
) -> tuple[list[str], dict[str, str]]:
    """The overrides both sides of one mode's run get, and their environment; the model is
    prepared and the run's resolved config written to `run_dir/config.toml`."""
    from dora.config import load_config
    from dora.config_text import render_toml
    from dora.models.prepare import prepare_model

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
    return settings, env


class _Window:
    """The CPU of a run's processes sampled while it runs, kept at the two ends of its steady
    window: once `first` steps were trained and once `last` were."""

    def __init__(self, counter: TrainedCounter, *, first: int, last: int) -> None:
        self.counter, self.first, self.last = counter, first, last
        self.at_first: dict[str, float] | None = None
        self.at_last: dict[str, float] | None = None
        self.latest: dict[str, float] | None = None
        self.loads: list[float] = []

    def sample(self, procs: dict[str, subprocess.Popen[bytes]]) -> None:
        """Keep a sample only while every side runs: a side that exited reads as no CPU."""
        cpu = {side: tree_cpu_s([p.pid]) for side, p in procs.items()}
        if any(p.poll() is not None for p in procs.values()):
            return
        cpu["serve_self"] = own_cpu_s(procs["serve"].pid)
        self.latest = cpu
        n = self.counter.poll()
        if n >= self.first and self.at_first is None:
            self.at_first = cpu
        if n >= self.last and self.at_last is None:
            self.at_last = cpu
        if self.at_first is not None and self.at_last is None:
            self.loads.append(os.getloadavg()[0])

    def record(self, procs: dict[str, subprocess.Popen[bytes]]) -> dict[str, float]:
        """`bench-cpu.json`: each side's CPU-seconds over the window and the mean load."""
        at_first, at_last = self.at_first, self.at_last
        if at_last is None and self.counter.poll() >= self.last:
            at_last = self.latest  # the run ended within one poll of its last step
        record: dict[str, float] = {}
        if at_first is not None and at_last is not None:
            for side in (*procs, "serve_self"):
                record[f"{side}_cpu_s"] = at_last[side] - at_first[side]
            record["window_cpu_s"] = record["serve_cpu_s"] + record["learn_cpu_s"]
        if self.loads:
            record["load_avg"] = sum(self.loads) / len(self.loads)
        return record


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
        help="the asynchronous modes' trainer threads (default: dora.cpu_plan's rule)",
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
    runs = _run_rounds(args, overrides, placements, out, steps=config.learn.steps)
    if runs is None:
        return 1
    results = [median_run(r) for r in runs.values()]
    loads = [r.load_avg for r in results if r.load_avg is not None]
    print()
    print(
        f"{config.serve.instances} instances, B={config.rollout.batch_size} "
        f"G={config.rollout.group_size} K={config.rollout.staleness} (dora, partial), "
        f"{config.learn.steps} steps; {len(cores)} cores; load average during the runs "
        + (f"{min(loads):.1f}-{max(loads):.1f}" if loads else "unknown")
    )
    bound = _print_results(runs, results, cores=len(cores), repeats=args.repeats)
    picture = plot_modes(results, out / "modes.png")
    print(f"\ntimelines of these runs, side by side: {picture}")
    ratios = ratio_lines(results)
    record = {
        "command": " ".join(["dora bench modes", *(argv or sys.argv[1:])]),
        "date": started,
        "machine": {"cores": cores, "cpu": cpu_model(), "python": platform.python_version()},
        "placements": [asdict(p) for p in placements],
        "results": [asdict(r) for r in results],
        "runs": {name: [asdict(r) for r in rs] for name, rs in runs.items()},
        "ratios": ratios,
        "bound_tokens_per_s": bound[0] if bound else None,
        "dora_round_bound_shares": round_bound_shares(runs, len(cores)),
    }
    (out / "bench-modes.json").write_text(json.dumps(record, indent=2))
    print()
    for line in ratios:
        print(line)
    return 0


def _run_rounds(
    args: argparse.Namespace,
    overrides: list[str],
    placements: list[CorePlan],
    out: Path,
    *,
    steps: int,
) -> dict[str, list[ModeResult]] | None:
    """Every mode `args.repeats` times, round robin so that a burst of load hits every mode
    alike (or, with `--reuse`, the run directories already in `out`); None once one fails."""
    runs: dict[str, list[ModeResult]] = {pl.name: [] for pl in placements}
    for rep in range(args.repeats):
        for pl in placements:
            run_dir = out / (pl.name if args.repeats == 1 else f"{pl.name}-{rep}")
            if not args.reuse:
                t0 = time.monotonic()
                code = run_mode(args.config, overrides, run_dir, pl, steps=steps)
                took = time.monotonic() - t0
                print(f"{pl.name}: exit {code} in {took:.0f} s ({run_dir})", flush=True)
                if code:
                    print(f"dora bench modes: {pl.name} failed; see {run_dir}", file=sys.stderr)
                    return None
            runs[pl.name].append(summarise(run_dir, name=pl.name, placement=pl.describe()))
    return runs


def _print_results(
    runs: dict[str, list[ModeResult]], results: list[ModeResult], *, cores: int, repeats: int
) -> tuple[float, ModeResult] | None:
    """The tables, each round's ratios and the machine's bound; returns the bound."""
    print(table(results))
    print("\nwhere the time goes (trainer waits: share of its step spent waiting for groups)")
    print(profile_table(results))
    if repeats > 1:
        print("(the run with the median tokens/s of each mode; all runs, tokens/s, and dora's")
        print(" ratio over each baseline within each round, where the host's speed is alike:)")
        for name, rs in runs.items():
            print(f"  {name}: " + ", ".join(f"{r.tokens_per_s:.0f}" for r in rs))
        for line in round_ratio_lines(runs):
            print(line)
    bound = machine_bound([r for rs in runs.values() for r in rs], cores)
    print()
    for line in bound_lines(results, bound):
        print(line)
    if repeats > 1:
        for line in round_bound_line(runs, cores):
            print(line)
    return bound


if __name__ == "__main__":
    raise SystemExit(main())
