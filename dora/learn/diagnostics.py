"""Off-policy diagnostics of one train step, overall and per staleness level: how far the data the
trainer learns from is from the policy it trains, and what the correction did about it.

A group's staleness level is `t - group.version` (the version of its first sampled token; the
gate bounds it by K). Per level and over the whole step, on the loss tokens:

- `is_ess`: Kish's effective sample size of the applied importance weights `rho` (after the
  correction), as a fraction of the tokens, `(sum rho)^2 / (n * sum rho^2)`: 1 when every weight is
  equal, near `1/n` when one token carries the step. Masked tokens count as weight 0.
- `is_ratio_p05`, `is_ratio_p50`, `is_ratio_p95`: quantiles of the raw ratio `pi_prox / mu`
  before the correction (`pi_theta / mu` under `off_policy = "none"`, where `rho = 1`). They come
  from a histogram of `log(pi_prox / mu)` in bins 0.01 wide centred on -3, -2.99, ..., 3
  (ratios 0.05 to 20; outside, the edge), so that ranks add their histograms like every other
  sum of the step: a quantile is exact to 0.5% inside that range, and a ratio of 1 is 1.
- `is_capped_fraction`: tokens whose weight the correction changed (truncated, raised, masked).
- `staleness_tokens_mean`: the token-weighted staleness, the mean over sampled tokens of
  `t - version of the token` (differs from the group's level only where a trajectory spans
  versions).
- `off_first_version_fraction`: sampled tokens whose version is not the version of their
  trajectory's first sampled token (0 by construction in every mode that pins a trajectory to one
  version); `trajectories_spanning_versions` counts the trajectories that have such tokens.

Pure: tensors and protocol values in, sums and numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dora.protocol import Group

LOG_RANGE = 3.0
BIN_WIDTH = 0.01
BINS = 601  # centred on the multiples of BIN_WIDTH in [-LOG_RANGE, LOG_RANGE], 0 among them
COUNTS = ("tokens", "rho_sum", "rho_sq_sum", "capped")
WIDTH = len(COUNTS) + BINS
QUANTILES = (("p05", 0.05), ("p50", 0.5), ("p95", 0.95))


def level_sums(
    *,
    rho: torch.Tensor,
    log_ratio: torch.Tensor,
    capped: torch.Tensor,
    active: torch.Tensor,
    levels: torch.Tensor,
    n_levels: int,
) -> torch.Tensor:
    """Sums of one micro-batch per staleness level, `[n_levels, WIDTH]` in float64: the `COUNTS`,
    then the histogram of `log_ratio`. Token tensors are [N, T]; `levels` [N] is each row's level
    (clamped into `[0, n_levels - 1]`)."""
    out = torch.zeros(n_levels, WIDTH, dtype=torch.float64)
    rows = levels.clamp(0, n_levels - 1).unsqueeze(-1).expand_as(active)[active].cpu()
    if rows.numel() == 0:
        return out
    w = rho.detach()[active].double().cpu()
    lr = log_ratio.detach()[active].double().cpu()
    out[:, 0].index_add_(0, rows, torch.ones_like(w))
    out[:, 1].index_add_(0, rows, w)
    out[:, 2].index_add_(0, rows, w * w)
    out[:, 3].index_add_(0, rows, capped[active].double().cpu())
    bins = ((lr.clamp(-LOG_RANGE, LOG_RANGE) + LOG_RANGE) / BIN_WIDTH).round().long()
    flat = rows * WIDTH + len(COUNTS) + bins
    out.view(-1).index_add_(0, flat, torch.ones_like(w))
    return out


def _quantile(hist: np.ndarray, q: float) -> float:
    """The ratio at quantile `q` of a histogram of log ratios (the centre of its bin)."""
    cdf = np.cumsum(hist)
    index = int(np.searchsorted(cdf, q * cdf[-1], side="left"))
    return float(np.exp(-LOG_RANGE + index * BIN_WIDTH))


def weight_metrics(sums: np.ndarray) -> dict[str, float]:
    """`is_*` numbers of one row of `level_sums` (or of their sum over levels)."""
    tokens, rho_sum, rho_sq_sum, capped = (float(x) for x in sums[: len(COUNTS)])
    if tokens == 0:
        return {}
    out = {
        "is_ess": rho_sum**2 / (tokens * rho_sq_sum) if rho_sq_sum > 0 else 0.0,
        "is_capped_fraction": capped / tokens,
    }
    hist = sums[len(COUNTS) :]
    for name, q in QUANTILES:
        out[f"is_ratio_{name}"] = _quantile(hist, q)
    return out


def version_sums(step: int, groups: Sequence[Group], n_levels: int) -> np.ndarray:
    """Per level `[sampled tokens, sum of their staleness, tokens off their trajectory's first
    version, trajectories that span versions]` over the unmasked samples of `groups`."""
    out = np.zeros((n_levels, 4))
    for g in groups:
        level = min(max(step - g.version, 0), n_levels - 1)
        for s in g.samples:
            if s.masked:
                continue
            versions = s.sampled_versions()
            if versions.size == 0:
                continue
            out[level] += (
                versions.size,
                float((step - versions.astype(np.int64)).sum()),
                float((versions != versions[0]).sum()),
                float((versions != versions[0]).any()),
            )
    return out


def version_metrics(sums: np.ndarray) -> dict[str, float]:
    """`staleness_tokens_mean`, `off_first_version_fraction` and
    `trajectories_spanning_versions` of one row of `version_sums`."""
    tokens, staleness, off_first, spanning = (float(x) for x in sums)
    if tokens == 0:
        return {}
    return {
        "staleness_tokens_mean": staleness / tokens,
        "off_first_version_fraction": off_first / tokens,
        "trajectories_spanning_versions": spanning,
    }


def step_diagnostics(step: int, groups: Sequence[Group], weights: np.ndarray) -> dict[str, float]:
    """The step's diagnostics: overall under their names, and per level `k` that has tokens as
    `staleness{k}/<name>`. `weights` is the step's `level_sums`, added over micro-batches and
    ranks."""
    n_levels = weights.shape[0]
    versions = version_sums(step, groups, n_levels)
    out = {**weight_metrics(weights.sum(0)), **version_metrics(versions.sum(0))}
    for k in range(n_levels):
        level = {**weight_metrics(weights[k]), **version_metrics(versions[k])}
        if level:
            level["tokens"] = float(versions[k][0])
            out.update({f"staleness{k}/{name}": value for name, value in level.items()})
    return out
