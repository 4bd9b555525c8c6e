"""Fit the calibrated constants on the paper's synchronous baseline, and only on it.

    python -m dora.sim.calibrate          # prints the fitted values and the checks

- Training: the paper's sync steps are 22.91 min at 64 GPUs (65% rollout) and 20.23 min at 128
  (73% rollout), so training (with the weight sync) takes 8.02 and 5.46 min of a step of about
  19.4M tokens (14,143 tokens/s x 22.91 min). `train = tokens * a / gpus + b` through both points
  gives `a` (GPU-seconds per token) and `b` (per-step overhead).
- Decode: `decode_overhead_ms` is bisected until the simulated sync rollout at 64 GPUs lasts
  14.9 min per step. The sync rollout at 128 GPUs (14.77 min) is then a check, not a fit.
- Workload: the response median is set so that a sample holds about 2,373 tokens (19.4M / 8,192),
  with the shape fixed by the paper's max / median of 28.
"""

from __future__ import annotations

import dataclasses

from dora.costs import Setup, preset
from dora.sim.events import simulate
from dora.sim.modes import plan
from dora.sim.report import summarize

__all__ = ["fit_decode_overhead", "fit_training", "sync_rollout_min"]

SYNC_64 = (22.91, 0.65, 14_143)
"""Paper: sync step (min), rollout share, tokens/s at 64 GPUs."""
SYNC_128 = (20.23, 0.73, 16_070)


def fit_training(setup: Setup) -> tuple[float, float]:
    """`(train_gpu_s_per_token, train_step_overhead_s)` through the two sync points."""
    points = []
    for gpus, (step, share, tps) in ((64, SYNC_64), (128, SYNC_128)):
        tokens = tps * step * 60
        train_s = step * 60 * (1 - share) - setup.weight_sync_s
        points.append((tokens / gpus, train_s))
    (x1, y1), (x2, y2) = points
    a = (y1 - y2) / (x1 - x2)
    return a, y1 - a * x1


def sync_rollout_min(setup: Setup, *, seed: int = 0) -> tuple[float, float]:
    """Simulated sync `(rollout min per step, step min)`."""
    m = summarize(simulate(setup, plan("sync", setup), seed=seed))
    return m["rollout_only_share"] * m["step_min"], m["step_min"]


def fit_decode_overhead(setup: Setup, *, target_min: float = SYNC_64[0] * SYNC_64[1]) -> float:
    """Bisect `decode_overhead_ms` on the sync rollout time of `setup` (its steps and seed 0)."""
    s = setup
    lo, hi = 0.0, 40.0
    for _ in range(7):
        mid = (lo + hi) / 2
        rollout, _ = sync_rollout_min(dataclasses.replace(s, decode_overhead_ms=mid))
        lo, hi = (mid, hi) if rollout < target_min else (lo, mid)
    return round((lo + hi) / 2, 1)


def main() -> None:
    base = preset("paper-64")
    a, b = fit_training(base)
    print(f"train_gpu_s_per_token = {a:.4g}   (preset: {base.train_gpu_s_per_token})")
    print(f"train_step_overhead_s = {b:.0f}   (preset: {base.train_step_overhead_s})")
    overhead = fit_decode_overhead(base)
    print(f"decode_overhead_ms = {overhead}   (preset: {base.decode_overhead_ms})")
    for name, (step, share, _) in (("paper-64", SYNC_64), ("paper-128", SYNC_128)):
        rollout, sim_step = sync_rollout_min(preset(name))
        print(
            f"{name} sync: rollout {rollout:.2f} min (paper {step * share:.2f}),"
            f" step {sim_step:.2f} min (paper {step:.2f})"
        )


if __name__ == "__main__":
    main()
