"""The policy-gradient objective of `dora learn`: pure functions over tensors, no I/O, no state.

The step objective over the sequences `i` and their sampled tokens `t` is

    L = (1 / Z) * sum_i sum_t  w_i * l_it,      l_it = -rho_it * min(r_it A_i, clip(r_it) A_i)
                                                         + kl_coef * k3_it

- `A_i` are group-relative advantages (`group_advantages`): GRPO `(R_i - mean) / (std + eps)`,
  Dr. GRPO `R_i - mean` (no std, which biases towards groups with little spread).
- `r_it = pi_theta / pi_old` is clipped to `[1 - clip_low, 1 + clip_high]` (DAPO clip-higher when
  `clip_high > clip_low`). The `old` policy depends on `off_policy`:
  `none`: the behaviour logprobs the sampler reported (plain PPO against the sampler; rho = 1);
  `tis` and `decoupled`: the *proximal* policy, the trainer's own logprobs with the weights at the
  start of the step (decoupled PPO, AReaL). `rho = pi_prox / pi_behaviour` then corrects the gap
  between the sampler and the proximal policy (staleness up to K versions, and trainer/inference
  numeric mismatch). `tis` truncates it at `tis_cap` (truncated importance sampling); `decoupled`
  keeps it unclipped but drops tokens whose weight exceeds `tis_cap` (AReaL's behaviour-weight cap).
  `icepop` keeps it unclipped where it lies in `[icepop_low, icepop_high]` and drops the token
  elsewhere (IcePop's two-sided mask). `mis` weighs a whole sequence by one ratio, the geometric
  mean or the product of its token ratios, clamped into `[mis_low, mis_high]` or, with
  `mis_action = "mask"`, dropping the sequence outside it (sequence-level masked importance
  sampling).
- GSPO (`loss = "gspo"`) replaces the token ratio by the sequence ratio
  `s_i = exp(mean_t log(pi_theta / pi_old))`, applied per token as `sg[s_i] * pi/sg[pi]` so the
  gradient is `s_i A_i grad mean_t log pi`; its `tis`/`decoupled` weight is the sequence-level one
  too (`icepop` stays per token, `mis` is per sequence anyway).
- `k3 = exp(ref - theta) - (ref - theta) - 1` is Schulman's unbiased, non-negative KL estimator to a
  reference policy (the initial weights).
- `w_i` and `Z` implement the aggregation and are chosen in `dora.learn.batching`: token-level
  (`w = 1`, `Z = total loss tokens`), sequence-level (`w = 1 / n_i`, `Z = sequences`) and Dr. GRPO
  (`w = 1`, `Z = sequences * max_tokens`, a constant per sequence).

`policy_loss` returns the *unnormalised* sum `sum w * l` plus statistics as sums, so the trainer can
accumulate micro-batches as groups stream in and divide by the step's `Z` once it is known: the
normalisation over the whole step is exact whatever the arrival order or the rank split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

if TYPE_CHECKING:
    from dora.config import LearnConfig

LossKind = Literal["grpo", "dr_grpo", "gspo"]
OffPolicy = Literal["none", "tis", "decoupled", "icepop", "mis"]

ADVANTAGE_EPS = 1e-6  # keeps a group with a tiny spread from exploding; std is unbiased (TRL's)


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """The knobs of the objective (mirrors `learn.*` in the config)."""

    loss: LossKind = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    off_policy: OffPolicy = "tis"
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    mis_ratio: Literal["geometric", "product"] = "geometric"
    mis_action: Literal["truncate", "mask"] = "truncate"
    mis_low: float = 0.0
    mis_high: float = 2.0
    kl_coef: float = 0.0

    @classmethod
    def from_config(cls, learn: LearnConfig) -> LossSettings:
        """The objective `learn.*` describes."""
        return cls(
            loss=learn.loss,
            clip_low=learn.clip_low,
            clip_high=learn.clip_high,
            off_policy=learn.off_policy,
            tis_cap=learn.tis_cap,
            icepop_low=learn.icepop.low,
            icepop_high=learn.icepop.high,
            mis_ratio=learn.mis.ratio,
            mis_action=learn.mis.action,
            mis_low=learn.mis.low,
            mis_high=learn.mis.high,
            kl_coef=learn.kl_coef,
        )


class LossTerms(NamedTuple):
    """`loss_sum`: differentiable, unnormalised; `stats`: detached sums over active tokens;
    per token, detached, for the diagnostics (`dora.learn.diagnostics`): `rho` the applied
    importance weight, `log_ratio` the raw `log(pi_prox / mu)` (`log(pi_theta / mu)` without a
    correction), `capped` where the correction changed the weight."""

    loss_sum: torch.Tensor
    stats: dict[str, float]
    rho: torch.Tensor
    log_ratio: torch.Tensor
    capped: torch.Tensor


def group_advantages(
    rewards: npt.ArrayLike, valid: npt.ArrayLike, *, scale: bool
) -> npt.NDArray[np.float64]:
    """Group-relative advantages of one group. Invalid (masked) samples get 0 and are left out of
    the mean and std. `scale=True` is GRPO (divide by the unbiased std + eps), False Dr. GRPO."""
    r = np.asarray(rewards, dtype=np.float64)
    ok = np.asarray(valid, dtype=bool)
    out = np.zeros_like(r)
    if ok.sum() < 2:
        return out  # no baseline to compare with: no signal
    mean = r[ok].mean()
    out[ok] = r[ok] - mean
    if scale:
        out[ok] /= r[ok].std(ddof=1) + ADVANTAGE_EPS
    return out


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) under `logits` ([N, T, V] and [N, T]), computed in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each next-token distribution ([N, T, V] -> [N, T]), for metrics only."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def importance_weights(
    log_rho: torch.Tensor, active: torch.Tensor, settings: LossSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights `rho` that `settings.off_policy` makes of the log importance ratios
    `log(pi_prox / mu)` ([N, T]), and which active tokens the correction changed (truncated,
    raised or masked). Inactive tokens (weight 0) take no part in a sequence's ratio."""
    act = active.to(log_rho.dtype)
    log_rho = torch.where(active, log_rho, torch.zeros_like(log_rho))
    tokens_per_row = act.sum(-1).clamp_min(1.0)
    if settings.off_policy == "mis":
        seq = (log_rho * act).sum(-1)
        if settings.mis_ratio == "geometric":
            seq = seq / tokens_per_row
        ratio = seq.exp().unsqueeze(-1).expand_as(log_rho)
        outside = (ratio < settings.mis_low) | (ratio > settings.mis_high)
        if settings.mis_action == "truncate":
            rho = ratio.clamp(settings.mis_low, settings.mis_high)
        else:
            rho = torch.where(outside, torch.zeros_like(ratio), ratio)
        return rho, outside & active
    if settings.loss == "gspo" and settings.off_policy in ("tis", "decoupled"):
        seq = (log_rho * act).sum(-1) / tokens_per_row
        log_rho = seq.unsqueeze(-1).expand_as(log_rho)
    raw = log_rho.exp()
    if settings.off_policy == "icepop":
        outside = (raw < settings.icepop_low) | (raw > settings.icepop_high)
        return torch.where(outside, torch.zeros_like(raw), raw), outside & active
    capped = raw > settings.tis_cap
    if settings.off_policy == "tis":
        return raw.clamp(max=settings.tis_cap), capped & active
    return torch.where(capped, torch.zeros_like(raw), raw), capped & active


def policy_loss(
    *,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    settings: LossSettings,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> LossTerms:
    """The unnormalised loss `sum w * l` of one micro-batch (see the module docstring).

    Token tensors are [N, T] (padded rows); `advantages` is [N]; `weights` is 0 on tokens without
    loss (prompt, padding, masked samples, zero-weight padding micro-batches). `proximal_logprobs`
    is required unless `off_policy == "none"`; `ref_logprobs` when `kl_coef > 0`.
    """
    active = weights > 0
    act = active.to(logprobs.dtype)
    tokens_per_row = act.sum(-1).clamp_min(1.0)
    if settings.off_policy == "none":
        old = behaviour_logprobs
        rho = torch.ones_like(logprobs)
        capped = torch.zeros_like(active)
        sampler_log_ratio = logprobs.detach() - behaviour_logprobs
    else:
        if proximal_logprobs is None:
            raise ValueError(f"off_policy={settings.off_policy!r} needs proximal_logprobs")
        old = proximal_logprobs
        sampler_log_ratio = proximal_logprobs - behaviour_logprobs
        rho, capped = importance_weights(sampler_log_ratio, active, settings)
    log_ratio = logprobs - old
    if settings.loss == "gspo":
        seq_log_ratio = (log_ratio.detach() * act).sum(-1) / tokens_per_row
        ratio = (seq_log_ratio.unsqueeze(-1) + logprobs - logprobs.detach()).exp()
    else:
        ratio = log_ratio.exp()
    adv = advantages.unsqueeze(-1).to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high) * adv
    per_token = -rho.detach() * torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logprobs)
    if settings.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        delta = ref_logprobs - logprobs
        kl = delta.exp() - delta - 1.0
        per_token = per_token + settings.kl_coef * kl
    loss_sum = (weights * per_token).sum()

    with torch.no_grad():
        r = ratio.detach()
        n = int(active.sum())
        stats = {
            "tokens": float(n),
            "clipped": float((active & (clipped < unclipped)).sum()),
            "ratio_sum": float((r * act).sum()),
            "ratio_max": float(r[active].max()) if n else 0.0,
            "ratio_min": float(r[active].min()) if n else 0.0,
            "is_weight_sum": float((rho * act).sum()),
            "is_capped": float((capped & active).sum()),
            "kl_sum": float((kl.detach() * act).sum()),
            "mismatch_sum": (
                float(((behaviour_logprobs - proximal_logprobs) * act).sum())
                if proximal_logprobs is not None
                else 0.0
            ),
        }
    return LossTerms(loss_sum, stats, rho.detach(), sampler_log_ratio.detach(), capped)
