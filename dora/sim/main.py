"""`dora simulate`: run the chosen modes of a preset and print one table per mode.

`--instances N` sets the whole pool to N instances: colocated modes generate on all of them,
disaggregated modes on the preset's rollout share of them (half, for the paper presets). The last
line printed is always `dora/sync throughput ratio: X.XX` (`n/a` when a mode is missing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from dora.costs import Setup, apply_overrides, preset, validate
from dora.errors import ConfigError
from dora.sim.events import Run, simulate
from dora.sim.modes import MODES, plan
from dora.sim.report import render, setup_dict, summarize, write_plot

__all__ = ["build_setup", "main"]


def build_setup(
    name: str, overrides: list[str], *, steps: int | None = None, instances: int | None = None
) -> Setup:
    s = apply_overrides(preset(name), overrides)
    if instances is not None:
        if instances < 2:
            raise ConfigError(f"--instances must be >= 2, got {instances}")
        tp = s.gpus_per_instance
        rollout = max(1, min(instances - 1, round(instances * s.rollout_gpus / s.gpus)))
        s = dataclasses.replace(s, gpus=instances * tp, rollout_gpus=rollout * tp)
    if steps is not None:
        if steps < 2:
            raise ConfigError(f"--steps must be >= 2, got {steps}")
        warmup = s.warmup_steps if s.warmup_steps < steps // 2 else max(1, steps // 4)
        s = dataclasses.replace(s, steps=steps, warmup_steps=warmup)
    validate(s)
    return s


def _timed(setup: Setup, mode: str, seed: int) -> tuple[Run, float]:
    t = time.perf_counter()
    return simulate(setup, plan(mode, setup), seed=seed), time.perf_counter() - t


def run_modes(setup: Setup, modes: list[str], *, seed: int) -> list[tuple[Run, float]]:
    """Each mode is independent and deterministic: run them in parallel processes when there
    is more than one core (the results do not depend on it)."""
    workers = min(len(modes), os.cpu_count() or 1)
    if workers < 2:
        return [_timed(setup, m, seed) for m in modes]
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_timed, setup, m, seed) for m in modes]
        return [f.result() for f in futures]


def main(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in str(args.modes).split(",") if m.strip()]
    if not modes:
        raise ConfigError("--modes is empty")
    for m in modes:
        if m not in MODES:
            raise ConfigError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    setup = build_setup(
        args.preset, list(args.overrides or []), steps=args.steps, instances=args.instances
    )
    started = time.perf_counter()
    runs = run_modes(setup, modes, seed=args.seed)
    summaries = []
    for run, wall in runs:
        summary = summarize(run)
        summary["wall_s"] = wall
        summaries.append(summary)
    title = f"{setup.name} ({setup.gpus} GPUs, {setup.steps} steps, seed {args.seed})"
    print(render(summaries, title=title), end="")
    by_mode = {s["mode"]: s for s in summaries}
    ratio: float | None = None
    if "dora" in by_mode and "sync" in by_mode:
        ratio = by_mode["dora"]["tokens_per_s"] / by_mode["sync"]["tokens_per_s"]
    if args.json:
        doc = {
            "preset": setup.name,
            "seed": args.seed,
            "setup": setup_dict(setup),
            "modes": by_mode,
            "dora_sync_ratio": ratio,
            "wall_s": time.perf_counter() - started,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if args.plot:
        write_plot([run for run, _ in runs], args.plot)
    if len(summaries) > 1:
        unit, scale = ("s", 60.0) if max(s["step_min"] for s in summaries) < 1 else ("min", 1.0)
        steps = ", ".join(f"{s['mode']} {s['step_min'] * scale:.2f}" for s in summaries)
        print(f"step time ({unit}): {steps}")
    if "dora" in by_mode and "inflight" in by_mode:
        vs = by_mode["dora"]["tokens_per_s"] / by_mode["inflight"]["tokens_per_s"]
        print(f"dora/inflight throughput ratio: {vs:.2f}")
    print(f"dora/sync throughput ratio: {'n/a' if ratio is None else f'{ratio:.2f}'}")
    return 0
