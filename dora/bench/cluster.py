"""`dora bench cluster --preset paper-64`: the four modes on emulated accelerators, back to back.

Each mode is a real `dora serve` + `dora learn` run (launched as `dora bench modes` launches one,
`dora.bench.modes.run_mode`) on `serve.backend = "emulated"` and `emulate.trainer`: the instances
and the trainer spend the simulator's modelled time (`dora.costs`, the preset named) instead
of compute, on a clock `--time-scale` times real time; everything else is the real code. The
mode's shape is the simulator's (`dora.sim.modes.plan`): instances (colocated modes get the whole
pool, the disaggregated ones the rollout pool), the trainer's GPUs, K, and whether the trainer
shares the instances' GPUs (colocated: it pauses them while it trains) or streams.

Each mode is measured in its steady state, as the simulator and the paper average iterations
after a warm-up: it trains `K + --steps` steps (K its staleness bound: 0 for sync) and the window
runs from the end of step K to the end of the last. Until step K the run still drains its start:
the groups admitted at version 0, while every instance held it, may be trained on until then.

Printed: the table of `dora bench modes` (real seconds), then emulated against simulated in
modelled units (tokens/s and step time; prompt and response tokens, as the simulator counts), and
the real overheads of the real code: serve's own CPU (the `dora serve` process, without the
emulated instances' process), its event-loop lag (median and p99 of the ticks) and stall (the
longest wait of any wake-up between two ticks: p99 over the ticks and the run's longest), the
emulated cluster's own lag, the peak resident memory of serve and of the emulated cluster, link
messages and bytes per second, journal writes per second, and the time spent inside the
transfer queue and the orchestrator per step. Every run is checked (`dora.emulated.checks`:
C1-C3 and the accounting on every consumed group). The ratio lines come
last, `dora/sync throughput ratio: X.XX` the very last.

The default time scale fits the whole preset in about `--budget-min` minutes: the simulator's
predicted modelled duration of the four runs, divided into the budget. At a smaller scale the
real code's per-request costs weigh more against each modelled second: the result holds while
serve's CPU stays well below one core and its lag is small against a decode step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from dora.bench import summary
from dora.bench.modes import CorePlan, run_mode
from dora.bench.modes_report import ModeResult, ratio_lines, render, summarise, table
from dora.costs import Setup, apply_overrides, preset
from dora.emulated.checks import check_run
from dora.looplag import p99
from dora.records import Tick
from dora.report import load_run
from dora.sim.events import Run, simulate
from dora.sim.modes import MODES, PAPER_MODES, ModePlan
from dora.sim.modes import plan as mode_plan

__all__ = ["default_time_scale", "main", "mode_overrides", "predicted", "warmup_steps"]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "emulated" / "cluster.toml"
_STARTUP_S = 20.0
"""Real seconds a run takes to start and stop (processes, the first fill's setup)."""


def emulated_placement(mode: str, cores: list[int]) -> CorePlan:
    """Every mode shares every core, unpinned, one thread a process: the emulated compute spends
    modelled time, not cores, so only serve's and the trainer's own code runs on them."""
    return CorePlan(
        name=mode,
        mode=mode,
        kind="shared",
        serve_cores=cores,
        trainer_cores=cores,
        instance_threads=1,
        trainer_threads=1,
    )


def predicted(setup: Setup, plan: ModePlan, *, steps: int) -> Run:
    """The simulator's run of `plan`: its warm-up and `steps` steps, as the emulated run."""
    return simulate(
        dataclasses.replace(setup, steps=warmup_steps(plan) + steps, warmup_steps=0), plan, seed=0
    )


def warmup_steps(plan: ModePlan) -> int:
    """The steps before a mode's measured window: its first K (the staleness bound). The groups
    admitted at version 0, while every instance holds it, may be trained on until step K, so
    until then the run still drains its start (at paper-128, dora's step 3 is twice its later
    ones); from the end of step K on it is in the state a long run stays in."""
    return plan.staleness


def _window(run: Run, warmup: int) -> tuple[float, float]:
    """(tokens per modelled second, modelled seconds per step) from the end of trained step
    `warmup` to the end of the last."""
    ends = run.step_end_s[warmup:]
    span = ends[-1] - ends[0]
    tokens = sum(run.step_tokens[warmup + 1 :])
    return (tokens / span if span > 0 else 0.0), span / max(1, len(ends) - 1)


def default_time_scale(
    setup: Setup, *, steps: int, budget_s: float, modes: Sequence[str] = PAPER_MODES
) -> float:
    """The scale that fits the runs' predicted modelled time into `budget_s` real seconds."""
    total = sum(predicted(setup, mode_plan(m, setup), steps=steps).step_end_s[-1] for m in modes)
    return max(1e-4, (budget_s - len(modes) * _STARTUP_S) / total)


def mode_overrides(
    setup: Setup, plan: ModePlan, *, preset_name: str, cost: list[str], steps: int, scale: float
) -> list[str]:
    """The config overrides that give one mode the simulator's shape."""
    n_tasks = max(1024, setup.groups_per_step * 4)
    agentic: list[str] = []
    if setup.turns > 1:
        agentic = [
            "env.cls=envs.emulated:AgenticWorkloadEnv",
            f"env.kwargs={{ turns = {setup.turns}, tool_latency_s = {setup.tool_latency_s}, "
            f"tool_tokens = {setup.tool_tokens}, context_max = {setup.context_max}, "
            f"time_scale = {scale!r} }}",
            "rollout.max_turns=1000",
            f"rollout.max_tokens_per_turn={setup.response_max}",
            f"rollout.max_tokens={setup.context_max}",
            f"model.max_model_len={setup.context_max + 64}",
        ]
    return [
        "serve.backend=emulated",
        f"serve.instances={plan.instances}",
        f"serve.max_running={setup.max_seqs}",
        f"rollout.staleness={plan.staleness}",
        f"rollout.group_size={setup.group_size}",
        f"rollout.batch_size={setup.groups_per_step}",
        f"rollout.max_tokens={setup.response_max}",
        f"model.max_model_len={setup.prompt_max + setup.response_max + 64}",
        f"learn.steps={steps}",
        "emulate.trainer=true",
        f"emulate.preset={preset_name}",
        f"emulate.overrides={json.dumps(cost)}",
        f"emulate.time_scale={scale!r}",
        f"emulate.train_gpus={plan.train_gpus}",
        f"emulate.stream_training={str(setup.stream_training and not plan.colocated).lower()}",
        f"emulate.colocated={str(plan.colocated).lower()}",
        f"data.kwargs={{ n = {n_tasks}, prompt_median = {setup.prompt_median}, "
        f"prompt_sigma = {setup.prompt_sigma}, prompt_max = {setup.prompt_max} }}",
        *agentic,
    ]


@dataclasses.dataclass(kw_only=True)
class Overheads:
    """The real code's own costs in one run (real seconds unless named otherwise)."""

    tokens_per_s_modelled: float
    step_s_modelled: float
    serve_self_cores: float | None
    cluster_cores: float | None
    lag_ms_median: float
    lag_ms_p99: float
    stall_ms_p99: float
    """Serve's longest event-loop stall per tick (`Tick.loop_stall_ms`), p99 over the ticks."""
    stall_ms_max: float
    cluster_lag_ms_p99: float
    serve_rss_mb: float
    """Peak resident memory of the `dora serve` process."""
    cluster_rss_mb: float
    """Peak resident memory of the emulated instances' process."""
    link_msgs_per_s: float
    link_mb_per_s: float
    journal_writes_per_s: float
    core_s_per_step: float
    core_share: float
    core_by_call: dict[str, float]
    call_cpu_us: dict[str, float]
    """Serve's CPU per model call in microseconds: `total` (the process's CPU from its first tick
    to its last over the calls of the run), its measured parts and `rest` (the event loop, the
    HTTP stack, admission and completion)."""
    """The run's orchestration seconds by `Type.method` (its summary record)."""
    checked_groups: int
    problems: list[str]


def overheads(
    result: ModeResult, *, scale: float, warmup: int, checked: tuple[int, list[str]]
) -> Overheads:
    """Throughput over the window `result` is (from the end of trained step `warmup`); serve's
    CPU, lag, link, journal and orchestration over the whole run, from its first tick to its
    last trained step, and the cluster's CPU over its life: serve's busiest moments may fall
    before the window (when rollout is much faster than training, the window can hold training
    alone)."""
    run_dir = Path(result.run_dir)
    run = load_run(run_dir)
    everything = sorted(run.trained, key=lambda r: r.step)
    trained = everything[warmup:]
    t0, t1 = trained[0].time_s, trained[-1].time_s
    window = max(t1 - t0, 1e-9)
    seq_tokens = sum(r.numbers().get("sequence_tokens", 0.0) for r in trained[1:])
    ticks = [t for t in run.ticks if t.time_s <= t1]
    lags = sorted(t.loop_lag_ms for t in ticks) or [0.0]
    stalls = sorted(t.loop_stall_ms for t in ticks) or [0.0]

    def rate(of: Callable[[Tick], float]) -> float:
        """Per second between the run's first and last tick (0 with fewer than two)."""
        if len(ticks) < 2:
            return 0.0
        return (of(ticks[-1]) - of(ticks[0])) / (ticks[-1].time_s - ticks[0].time_s or 1e-9)

    serve_cores = rate(lambda t: t.cpu_s)
    msgs = rate(lambda t: t.link.sent_messages + t.link.received_messages)
    mb = rate(lambda t: t.link.sent_bytes + t.link.received_bytes) / 1e6
    core_share = rate(lambda t: t.core_s)
    core = (ticks[-1].core_s - ticks[0].core_s) / len(everything) if len(ticks) >= 2 else 0.0
    cluster_path = run_dir / "emulated-cluster.json"
    cluster = json.loads(cluster_path.read_text()) if cluster_path.is_file() else {}
    return Overheads(
        tokens_per_s_modelled=seq_tokens / (window / scale),
        step_s_modelled=result.step_s / scale,
        serve_self_cores=serve_cores if len(ticks) >= 2 else None,
        cluster_cores=cluster["cpu_s"] / cluster["wall_s"] if cluster.get("wall_s") else None,
        lag_ms_median=statistics.median(lags),
        lag_ms_p99=p99(lags),
        stall_ms_p99=p99(stalls),
        stall_ms_max=stalls[-1],
        cluster_lag_ms_p99=float(cluster.get("loop_lag_ms_p99", 0.0)),
        serve_rss_mb=max((t.peak_rss_mb for t in run.ticks), default=0.0),
        cluster_rss_mb=float(cluster.get("peak_rss_mb", 0.0)),
        link_msgs_per_s=msgs,
        link_mb_per_s=mb,
        journal_writes_per_s=rate(lambda t: t.journal_writes),
        core_s_per_step=core,
        core_share=core_share,
        core_by_call=dict(run.summary.core_s_by_call) if run.summary is not None else {},
        call_cpu_us=call_cpu_us(ticks, run.summary.model_calls, run.summary.call_cpu_s)
        if run.summary is not None
        else {},
        checked_groups=checked[0],
        problems=checked[1],
    )


def call_cpu_us(ticks: list[Tick], calls: int, parts: dict[str, float]) -> dict[str, float]:
    """Serve's CPU per model call in microseconds: `total`, each measured part, the `rest` of the
    serve process, and `runners` (the episode runners' processes, when there are any; the parts
    measured inside them are not split out)."""
    if calls <= 0 or len(ticks) < 2:
        return {}
    process = (ticks[-1].cpu_s - ticks[0].cpu_s) * 1e6 / calls
    runners = (ticks[-1].runner_cpu_s - ticks[0].runner_cpu_s) * 1e6 / calls
    out = {"total": process + runners} | {k: v * 1e6 / calls for k, v in sorted(parts.items())}
    out["rest"] = process - sum(v * 1e6 / calls for v in parts.values())
    if runners:
        out["runners"] = runners
    return out


def comparison_table(
    names: list[str], over: dict[str, Overheads], sims: dict[str, tuple[float, float]]
) -> str:
    head = (
        "mode",
        "tok/s emulated",
        "tok/s simulator",
        "diff",
        "step s emul.",
        "step s sim.",
        "serve CPU",
        "cluster CPU",
        "lag ms med/p99",
        "stall ms p99/max",
        "cluster lag p99",
        "RSS MB serve/cluster",
        "link msg/s",
        "link MB/s",
        "journal w/s",
        "orchestration/step",
    )
    rows = [head]
    for name in names:
        o, (sim_tps, sim_step) = over[name], sims[name]
        diff = (o.tokens_per_s_modelled / sim_tps - 1.0) if sim_tps else 0.0
        rows.append(
            (
                name,
                f"{o.tokens_per_s_modelled:.0f}",
                f"{sim_tps:.0f}",
                f"{100 * diff:+.1f}%",
                f"{o.step_s_modelled:.0f}",
                f"{sim_step:.0f}",
                "-" if o.serve_self_cores is None else f"{o.serve_self_cores:.2f}",
                "-" if o.cluster_cores is None else f"{o.cluster_cores:.2f}",
                f"{o.lag_ms_median:.1f}/{o.lag_ms_p99:.1f}",
                f"{o.stall_ms_p99:.1f}/{o.stall_ms_max:.1f}",
                f"{o.cluster_lag_ms_p99:.1f}",
                f"{o.serve_rss_mb:.0f}/{o.cluster_rss_mb:.0f}",
                f"{o.link_msgs_per_s:.1f}",
                f"{o.link_mb_per_s:.1f}",
                f"{o.journal_writes_per_s:.1f}",
                f"{1000 * o.core_s_per_step:.0f} ms ({100 * o.core_share:.2f}%)",
            )
        )
    return render(rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dora bench cluster", description=summary(__doc__))
    p.add_argument("--preset", default="paper-64", help="paper-64, paper-128 or agentic")
    p.add_argument("--time-scale", type=float, default=None, help="real s per modelled s")
    p.add_argument("--budget-min", type=float, default=13.0, help="target minutes (default scale)")
    p.add_argument(
        "--steps",
        type=int,
        default=5,
        help="train steps per mode after its warm-up (its first K steps); the window measured "
        "runs from the end of the first of them to the end of the last",
    )
    p.add_argument("--modes", default=",".join(PAPER_MODES), help=f"from {', '.join(MODES)}")
    p.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="key=value",
        help="cost-model override, as `dora simulate` takes them",
    )
    p.add_argument("--config", default=str(CONFIG), help="the shared config")
    p.add_argument("--out", default=None, help="output folder (default runs/bench-cluster-<time>)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    setup = apply_overrides(preset(args.preset), list(args.cost))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    steps = args.steps
    budget = 60 * args.budget_min
    scale = args.time_scale or default_time_scale(setup, steps=steps, budget_s=budget, modes=modes)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"runs/bench-cluster-{args.preset}-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    cores = sorted(os.sched_getaffinity(0))
    print(
        f"{args.preset}: B={setup.groups_per_step} G={setup.group_size} K={setup.staleness}, "
        f"{steps} steps per mode after a warm-up of its first K steps, time scale {scale:.4g} "
        f"(1 modelled s = {1000 * scale:.1f} real ms); {len(cores)} cores",
        flush=True,
    )
    measured = _run_modes(args, setup, modes, out=out, scale=scale, cores=cores)
    if measured is None:
        return 1
    results, over, sims = measured
    failed = _print_report(modes, results, over, sims)
    ratios = ratio_lines(results)
    record = {
        "command": " ".join(["dora bench cluster", *(argv or sys.argv[1:])]),
        "date": started,
        "preset": args.preset,
        "time_scale": scale,
        "steps": steps,
        "warmup_steps": {m: warmup_steps(mode_plan(m, setup)) for m in modes},
        "results": [dataclasses.asdict(r) for r in results],
        "overheads": {k: dataclasses.asdict(v) for k, v in over.items()},
        "simulator": {k: {"tokens_per_s": v[0], "step_s": v[1]} for k, v in sims.items()},
        "ratios": ratios,
    }
    (out / "bench-cluster.json").write_text(json.dumps(record, indent=2))
    print()
    for line in ratios:
        print(line)
    return 1 if failed else 0


def _run_modes(
    args: argparse.Namespace,
    setup: Setup,
    modes: list[str],
    *,
    out: Path,
    scale: float,
    cores: list[int],
) -> tuple[list[ModeResult], dict[str, Overheads], dict[str, tuple[float, float]]] | None:
    """Run each mode, check it and measure it; with the simulator's prediction of each (tokens
    per modelled second, modelled seconds per step). None once a run fails."""
    results: list[ModeResult] = []
    over: dict[str, Overheads] = {}
    sims: dict[str, tuple[float, float]] = {}
    for name in modes:
        plan = mode_plan(name, setup)
        warmup = warmup_steps(plan)
        total = warmup + args.steps
        sims[name] = _window(predicted(setup, plan, steps=args.steps), warmup)
        run_dir = out / name
        settings = [
            *mode_overrides(
                setup, plan, preset_name=args.preset, cost=args.cost, steps=total, scale=scale
            ),
            *args.overrides,
        ]
        placement = emulated_placement(name, cores)
        t0 = time.monotonic()
        code = run_mode(args.config, settings, run_dir, placement, steps=total, warmup=warmup)
        print(f"{name}: exit {code} in {time.monotonic() - t0:.0f} s ({run_dir})", flush=True)
        if code:
            print(f"dora bench cluster: {name} failed; see {run_dir}", file=sys.stderr)
            return None
        where = f"{plan.instances} inst" + (" colocated" if plan.colocated else "")
        result = summarise(run_dir, name=name, placement=where, warmup=warmup)
        check = check_run(
            run_dir,
            steps=total,
            batch_size=setup.groups_per_step,
            staleness=plan.staleness,
            spans_versions=name == "partial",
        )
        results.append(result)
        over[name] = overheads(
            result, scale=scale, warmup=warmup, checked=(check.groups_checked, check.problems)
        )
    return results, over, sims


def _print_report(
    modes: list[str],
    results: list[ModeResult],
    over: dict[str, Overheads],
    sims: dict[str, tuple[float, float]],
) -> bool:
    """The tables, each run's checks and the simulator's ratios; True when a check failed."""
    loads = [r.load_avg for r in results if r.load_avg is not None]
    print()
    print(
        "load average during the runs "
        + (f"{min(loads):.1f}-{max(loads):.1f}" if loads else "unknown")
        + "; real seconds:"
    )
    print(table(results))
    print("\nemulated vs simulated (modelled units: prompt + response tokens, seconds), and the")
    print(
        "real code's overheads over the whole run (serve CPU: the dora serve process in cores,"
        " cluster CPU: the emulated instances' process; lag: how late serve's one-second tick"
        " woke; stall: the longest any of serve's wake-ups waited between two ticks)"
    )
    print(comparison_table(modes, over, sims))
    failed = False
    for name in modes:
        o = over[name]
        status = "ok" if not o.problems else "FAILED: " + "; ".join(o.problems[:5])
        failed |= bool(o.problems)
        print(f"checks {name}: C1-C3 and accounting on {o.checked_groups} groups: {status}")
        if o.core_by_call:
            top = sorted(o.core_by_call.items(), key=lambda kv: -kv[1])[:4]
            parts = ", ".join(f"{k} {v:.2f} s" for k, v in top)
            print(f"orchestration {name}, whole run, largest: {parts}")
        if o.call_cpu_us:
            parts = ", ".join(f"{k} {v:.0f}" for k, v in o.call_cpu_us.items())
            print(f"serve CPU per model call {name}, us: {parts}")
    if "dora" in sims:
        sim_lines = [
            f"simulator dora/{m}: {sims['dora'][0] / sims[m][0]:.2f}"
            for m in ("one_step_off", "partial", "sync")
            if m in sims and sims[m][0] > 0
        ]
        print("\n" + ", ".join(sim_lines))
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
