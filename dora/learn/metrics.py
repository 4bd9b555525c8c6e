"""The metrics of one train step (`StepDone.metrics`), from sums the ranks have already reduced.

Pure: the trainer accumulates per-update sums (in `SUMS` order) on each rank, all-reduces them,
and this module turns them into means. Token means are over the loss tokens of the whole step;
`loss` is the mean over the updates of each update's normalised loss `sum w * l / Z_u`.
"""

from __future__ import annotations

from collections.abc import Sequence

from dora.learn.batching import PreparedGroup

SUMS = (
    "loss",
    "tokens",
    "clipped",
    "ratio_sum",
    "is_weight_sum",
    "is_capped",
    "kl_sum",
    "mismatch_sum",
    "entropy_sum",
)


def step_metrics(
    *,
    step: int,
    prepared: Sequence[PreparedGroup],
    duplicates: int,
    sums: Sequence[Sequence[float]],
    norms: Sequence[float],
    ratio_max: float,
    ratio_min: float,
    grad_norms: Sequence[float],
    ranks: int,
) -> dict[str, float]:
    """`sums[u][k]` is update u's global sum of `SUMS[k]`; `norms[u]` its normaliser Z_u."""
    total = {k: sum(row[i] for row in sums) for i, k in enumerate(SUMS)}
    tokens = max(total["tokens"], 1.0)
    losses = [row[0] / z for row, z in zip(sums, norms, strict=True) if z > 0]
    groups = [p.group for p in prepared]
    kept = [s for g in groups for s in g.samples if not s.masked]
    rewards = [s.reward for s in kept]
    staleness = [step - g.version for g in groups] or [0]
    components: dict[str, list[float]] = {}
    for s in kept:
        for name, value in s.reward_components.items():
            components.setdefault(name, []).append(value)
    episodes = max(len(kept), 1)
    return {
        **{f"reward/{name}": sum(v) / len(v) for name, v in sorted(components.items())},
        "turns_mean": sum(s.num_turns for s in kept) / episodes,
        "tool_calls_mean": sum(s.num_tool_calls for s in kept) / episodes,
        # agents' own loops (dora.endpoint): calls whose prompt did not extend the sequence so far
        "history_edits": float(sum(int(s.metadata.get("history_edits", "0")) for s in kept)),
        "loss": sum(losses) / len(losses) if losses else 0.0,
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "entropy": total["entropy_sum"] / tokens,
        "clip_fraction": total["clipped"] / tokens,
        "ratio_mean": total["ratio_sum"] / tokens,
        "ratio_max": ratio_max if total["tokens"] else 0.0,
        "ratio_min": ratio_min if total["tokens"] else 0.0,
        "is_weight_mean": total["is_weight_sum"] / tokens,
        "is_capped_fraction": total["is_capped"] / tokens,
        "kl": total["kl_sum"] / tokens,
        "mismatch_k1": total["mismatch_sum"] / tokens,
        "tokens": total["tokens"],
        "groups": float(len(groups)),
        "filtered_groups": float(sum(p.filtered for p in prepared)),
        "duplicate_groups": float(duplicates),
        "masked_samples": float(sum(p.masked_samples for p in prepared)),
        # sampled tokens not of their group's version (C1: 0 except in partial mode)
        "off_version_tokens": float(
            sum(int((s.sampled_versions() != g.version).sum()) for g in groups for s in g.samples)
        ),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": float(max(staleness)),
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "version": float(step + 1),
        "ranks": float(ranks),
    }
