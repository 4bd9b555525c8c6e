"""Every loss variant against values worked out by hand in the comments."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dora.learn.loss import (
    LossSettings,
    group_advantages,
    policy_loss,
    token_entropy,
    token_logprobs,
)

HALF = math.log(0.5)


def test_grpo_advantages_use_the_unbiased_std() -> None:
    # rewards 1 0 0 1: mean 0.5, deviations +-0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    a = group_advantages([1, 0, 0, 1], [True] * 4, scale=True)
    np.testing.assert_allclose(a, [0.866025, -0.866025, -0.866025, 0.866025], atol=1e-5)


def test_dr_grpo_advantages_only_subtract_the_mean() -> None:
    a = group_advantages([1, 0, 0, 1], [True] * 4, scale=False)
    np.testing.assert_allclose(a, [0.5, -0.5, -0.5, 0.5])


def test_masked_samples_are_left_out_of_the_baseline_and_get_zero() -> None:
    # valid rewards 1 0 0: mean 1/3, deviations 2/3 -1/3 -1/3, std sqrt((4+1+1)/9 / 2) = 0.57735
    a = group_advantages([1, 0, 5, 0], [True, True, False, True], scale=True)
    np.testing.assert_allclose(a, [1.154701, -0.577350, 0.0, -0.577350], atol=1e-5)


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0], [3.0]])
def test_no_spread_or_no_peer_gives_no_signal(rewards: list[float]) -> None:
    assert not group_advantages(rewards, [True] * len(rewards), scale=True).any()


def _ratios_case() -> tuple[torch.Tensor, torch.Tensor]:
    # two rows, three tokens; behaviour p = 0.5 everywhere; ratios pi/mu = 1.0, 1.5, 0.5
    behaviour = torch.full((2, 3), HALF)
    theta = (behaviour + torch.log(torch.tensor([1.0, 1.5, 0.5]))).requires_grad_(True)
    return theta, behaviour


def test_ppo_clip_against_behaviour_with_clip_higher() -> None:
    theta, behaviour = _ratios_case()
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([1.0, -1.0]),
        weights=torch.ones(2, 3),
        settings=LossSettings(off_policy="none", clip_low=0.2, clip_high=0.28),
    )
    # A = +1: min(r, clip(r)) = 1.0, 1.28, 0.5         -> l = -2.78 (token 2 clipped)
    # A = -1: min(-r, -clip(r)) = -1.0, -1.5, -0.8     -> l = +3.30 (token 3 clipped)
    assert out.loss_sum.item() == pytest.approx(0.52, abs=1e-5)
    out.loss_sum.backward()
    # d l / d theta = -A r where the unclipped term is chosen, 0 where the clipped one is
    assert theta.grad is not None
    torch.testing.assert_close(theta.grad, torch.tensor([[-1.0, 0.0, -0.5], [1.0, 1.5, 0.0]]))
    s = out.stats
    assert (s["tokens"], s["clipped"]) == (6.0, 2.0)
    assert s["ratio_sum"] == pytest.approx(6.0, abs=1e-5)
    assert (s["ratio_max"], s["ratio_min"]) == pytest.approx((1.5, 0.5), abs=1e-5)
    assert s["is_weight_sum"] == 6.0


def _rho_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # one row; the proximal policy equals theta (first update: ratio 1); rho = prox / mu = 0.5 1 4
    theta = torch.full((1, 3), HALF, requires_grad=True)
    proximal = theta.detach().clone()
    behaviour = proximal - torch.log(torch.tensor([[0.5, 1.0, 4.0]]))
    return theta, proximal, behaviour


def test_truncated_importance_weights_cap_rho() -> None:
    theta, proximal, behaviour = _rho_case()
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=behaviour,
        proximal_logprobs=proximal,
        advantages=torch.tensor([2.0]),
        weights=torch.ones(1, 3),
        settings=LossSettings(off_policy="tis", tis_cap=2.0),
    )
    # rho = 0.5, 1, min(4, 2) = 2; l = -rho * A * 1 summed = -2 * 3.5 = -7
    assert out.loss_sum.item() == pytest.approx(-7.0, abs=1e-5)
    out.loss_sum.backward()
    assert theta.grad is not None
    torch.testing.assert_close(theta.grad, torch.tensor([[-1.0, -2.0, -4.0]]))
    assert out.stats["is_capped"] == 1.0
    assert out.stats["is_weight_sum"] == pytest.approx(3.5, abs=1e-5)
    # mismatch = mean(mu - prox) = -(log .5 + log 1 + log 4) summed = -log 2
    assert out.stats["mismatch_sum"] == pytest.approx(-math.log(2.0), abs=1e-5)


def test_decoupled_ppo_drops_tokens_over_the_cap() -> None:
    theta, proximal, behaviour = _rho_case()
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=behaviour,
        proximal_logprobs=proximal,
        advantages=torch.tensor([2.0]),
        weights=torch.ones(1, 3),
        settings=LossSettings(off_policy="decoupled", tis_cap=2.0),
    )
    # rho = 0.5, 1, (4 > cap: dropped) 0; l = -2 * 1.5 = -3
    assert out.loss_sum.item() == pytest.approx(-3.0, abs=1e-5)
    out.loss_sum.backward()
    assert theta.grad is not None
    torch.testing.assert_close(theta.grad, torch.tensor([[-1.0, -2.0, 0.0]]))


def test_decoupled_clips_against_the_proximal_policy_not_the_sampler() -> None:
    # a later update: theta / prox = 1.5 is clipped at 1.28 whatever mu was; rho = prox / mu = 1
    proximal = torch.full((1, 1), HALF)
    theta = (proximal + math.log(1.5)).requires_grad_(True)
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=proximal.clone(),
        proximal_logprobs=proximal,
        advantages=torch.tensor([1.0]),
        weights=torch.ones(1, 1),
        settings=LossSettings(off_policy="decoupled", clip_high=0.28),
    )
    assert out.loss_sum.item() == pytest.approx(-1.28, abs=1e-5)
    assert out.stats["clipped"] == 1.0


def test_gspo_uses_the_sequence_ratio() -> None:
    # log ratios 0.2 and -0.4: s = exp(mean) = exp(-0.1) = 0.904837; clip range [0.95, 1.05]
    behaviour = torch.full((1, 2), HALF)
    settings = LossSettings(loss="gspo", off_policy="none", clip_low=0.05, clip_high=0.05)
    weights = torch.full((1, 2), 0.5)  # sequence aggregation: w = 1 / n
    theta = (behaviour + torch.tensor([[0.2, -0.4]])).requires_grad_(True)
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([1.0]),
        weights=weights,
        settings=settings,
    )
    # A = +1: min(s, 0.95) = s, not clipped: l = -s per token, times w = 1/2 twice -> -s
    assert out.loss_sum.item() == pytest.approx(-0.904837, abs=1e-5)
    out.loss_sum.backward()
    # gradient s * A * grad mean log pi: -s / 2 on each token
    assert theta.grad is not None
    torch.testing.assert_close(theta.grad, torch.full((1, 2), -0.452419), atol=1e-5, rtol=0)
    assert out.stats["ratio_sum"] == pytest.approx(2 * 0.904837, abs=1e-5)

    theta = (behaviour + torch.tensor([[0.2, -0.4]])).requires_grad_(True)
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([-1.0]),
        weights=weights,
        settings=settings,
    )
    # A = -1: min(-s, -0.95) = -0.95, clipped: l = 0.95, no gradient
    assert out.loss_sum.item() == pytest.approx(0.95, abs=1e-5)
    out.loss_sum.backward()
    assert theta.grad is not None and not theta.grad.any()
    assert out.stats["clipped"] == 2.0


def test_gspo_truncates_the_sequence_level_importance_weight() -> None:
    # log rho per token log 4 and 0: sequence rho = exp(log 4 / 2) = 2, capped at 1.5
    theta = torch.full((1, 2), HALF, requires_grad=True)
    proximal = theta.detach().clone()
    behaviour = proximal - torch.tensor([[math.log(4.0), 0.0]])
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=behaviour,
        proximal_logprobs=proximal,
        advantages=torch.tensor([1.0]),
        weights=torch.full((1, 2), 0.5),
        settings=LossSettings(loss="gspo", off_policy="tis", tis_cap=1.5),
    )
    assert out.loss_sum.item() == pytest.approx(-1.5, abs=1e-5)


def test_kl_to_reference_is_k3() -> None:
    # ref - theta = 0 and ln 2: k3 = 0 and 2 - ln 2 - 1 = 0.306853; A = 0 leaves only the KL
    theta = torch.full((1, 2), HALF, requires_grad=True)
    ref = theta.detach() + torch.tensor([[0.0, math.log(2.0)]])
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=theta.detach().clone(),
        proximal_logprobs=theta.detach().clone(),
        ref_logprobs=ref,
        advantages=torch.tensor([0.0]),
        weights=torch.ones(1, 2),
        settings=LossSettings(kl_coef=0.1),
    )
    assert out.loss_sum.item() == pytest.approx(0.0306853, abs=1e-6)
    out.loss_sum.backward()
    # d k3 / d theta = 1 - exp(ref - theta): 0 and -1, times 0.1
    assert theta.grad is not None
    torch.testing.assert_close(theta.grad, torch.tensor([[0.0, -0.1]]))
    assert out.stats["kl_sum"] == pytest.approx(0.306853, abs=1e-5)


def test_zero_weight_tokens_count_for_nothing() -> None:
    theta, behaviour = _ratios_case()
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([1.0, -1.0]),
        weights=torch.zeros(2, 3),
        settings=LossSettings(off_policy="none"),
    )
    assert out.loss_sum.item() == 0.0
    assert out.stats["tokens"] == 0.0 and out.stats["clipped"] == 0.0
    out.loss_sum.backward()  # still a graph: a padding micro-batch runs a real backward
    assert theta.grad is not None and not theta.grad.any()


def test_off_policy_correction_needs_the_proximal_policy() -> None:
    theta, behaviour = _ratios_case()
    with pytest.raises(ValueError, match="proximal"):
        policy_loss(
            logprobs=theta,
            behaviour_logprobs=behaviour,
            advantages=torch.zeros(2),
            weights=torch.ones(2, 3),
            settings=LossSettings(off_policy="tis"),
        )


def test_token_logprobs_and_entropy() -> None:
    # logits 0 and ln 3: p = 0.25, 0.75; entropy -(.25 ln .25 + .75 ln .75) = 0.562335
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    lp = token_logprobs(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert token_entropy(logits).item() == pytest.approx(0.562335, abs=1e-6)
