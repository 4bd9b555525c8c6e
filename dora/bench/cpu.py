"""Calibrate the simulator on this machine for the tiny model of a dora config, and predict the
modes of `dora bench modes` for that config.

    python -m dora.bench.cpu examples/math/bench.toml       # measure, fit, predict (~1.2 min)
    dora simulate --preset cpu-bench                        # the same prediction, from the
                                                            # stored constants (BENCH_COSTS)

It also prints the best serve side one core can give this workload: every measured group decoded
by one engine with continuous batching (`serve.max_running` rows), the fitted decode and prefill
costs replayed step by step. Under the split placement serve runs on one core, so no asynchronous
mode placed so can beat that rate, however well it schedules.

`cpu_measure.py` measures, `cpu_costs.py` holds the fits, the stored measurement and the `Setup`
derived from it; this module is the command that runs one, then the other, then the simulator.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dora.bench.cpu_costs import one_core_serve, overrides, setup_for, write_lengths
from dora.bench.cpu_measure import measure
from dora.config import load_config
from dora.costs import preset
from dora.sim.main import run_modes
from dora.sim.report import render, summarize

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dora.bench.cpu", description=__doc__.split("\n")[0])
    p.add_argument("config", help="the config of `dora bench modes`, e.g. examples/math/bench.toml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lengths-out",
        type=Path,
        default=Path("runs/sim-cpu-lengths.txt"),
        help="where to write the sampled groups' lengths (default: %(default)s)",
    )
    args = p.parse_intermixed_args(argv)
    # as `dora bench modes` runs every process: a 2-thread trainer spins at each OpenMP barrier
    # otherwise, and measured 10x slower than 1 thread on a loaded machine (docs/trainer.md)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    config = load_config(args.config, args.overrides)
    costs, groups = measure(config)
    lengths = write_lengths(args.lengths_out, groups)
    setup = setup_for(config, costs, lengths_file=lengths)
    print(f"\nmeasured: {costs}")
    print(f"sampled groups: {lengths}")
    serve_s = one_core_serve(costs, groups, max_running=config.serve.max_running)
    print(
        f"best serve side on one core (every group batched on one engine): "
        f"{1e3 * serve_s:.3f} ms per response token, {1 / serve_s:,.0f} tokens/s"
    )
    changed = overrides(setup, preset("cpu-bench"))
    print("\nthe same setup: dora simulate --preset cpu-bench " + " ".join(changed))
    modes = ["sync", "one_step_off", "partial", "dora"]
    summaries = [summarize(run) for run, _ in run_modes(setup, modes, seed=args.seed)]
    print(render(summaries, title=f"{setup.name} (predicted for {args.config})"), end="")
    by = {s["mode"]: s["tokens_per_s"] for s in summaries}
    for base in ("one_step_off", "partial", "sync"):
        print(f"dora/{base} throughput ratio: {by['dora'] / by[base]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
