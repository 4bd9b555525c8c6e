"""The sensitivity table of docs/simulator.md: one constant changed at a time, nothing refitted.

    python -m dora.sim.sensitivity [--preset paper-64] [--steps 16]

Each row runs all four modes of the preset with one override and prints a markdown row: the step
time of every mode and the dora/sync throughput ratio.
"""

from __future__ import annotations

import argparse

from dora.sim.events import simulate
from dora.sim.main import build_setup
from dora.sim.modes import PAPER_MODES, plan
from dora.sim.report import summarize

__all__ = ["VARIANTS", "main"]

VARIANTS: list[tuple[str, list[str]]] = [
    ("preset (calibrated)", []),
    ("decode overhead 10 ms (-23%)", ["decode_overhead_ms=10"]),
    ("decode overhead 16 ms (+23%)", ["decode_overhead_ms=16"]),
    ("HBM efficiency 0.55", ["hbm_efficiency=0.55"]),
    ("HBM efficiency 0.85", ["hbm_efficiency=0.85"]),
    ("split 24 rollout / 40 train GPUs", ["rollout_gpus=24"]),
    ("split 40 rollout / 24 train GPUs", ["rollout_gpus=40"]),
    ("group share of length variance 0.2", ["group_share=0.2"]),
    ("group share of length variance 0.8", ["group_share=0.8"]),
    ("max_seqs 128", ["max_seqs=128"]),
    ("max_seqs 512", ["max_seqs=512"]),
    ("TP8 instances", ["gpus_per_instance=8"]),
    ("weight sync 30 s", ["weight_sync_s=30"]),
    ("migration re-prefills (no KV transfer)", ["migrate_kv=0"]),
    ("trainer does not stream", ["stream_training=0"]),
    ("partial disaggregated", ["partial_colocated=0"]),
]


def row(preset: str, overrides: list[str], steps: int | None, seed: int) -> dict[str, float]:
    setup = build_setup(preset, overrides, steps=steps)
    out: dict[str, float] = {}
    for mode in PAPER_MODES:
        m = summarize(simulate(setup, plan(mode, setup), seed=seed))
        out[mode] = m["step_min"]
        out[f"{mode}_tps"] = m["tokens_per_s"]
    out["ratio"] = out["dora_tps"] / out["sync_tps"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dora.sim.sensitivity")
    p.add_argument("--preset", default="paper-64")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print("| change | sync | one_step_off | partial | dora | dora/sync tok/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, overrides in VARIANTS:
        r = row(args.preset, overrides, args.steps, args.seed)
        cells = " | ".join(f"{r[m]:.2f}" for m in PAPER_MODES)
        print(f"| {label} | {cells} | {r['ratio']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
