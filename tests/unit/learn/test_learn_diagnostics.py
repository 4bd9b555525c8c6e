"""The off-policy diagnostics of a step against values worked out by hand in the comments."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dora.learn.diagnostics import level_sums, step_diagnostics, version_sums, weight_metrics
from dora.learn.loss import LossSettings, policy_loss
from dora.protocol import Group, Sample


def _sample(versions: list[int], *, prompt: int = 2, masked: bool = False) -> Sample:
    n = prompt + len(versions)
    return Sample.build(
        token_ids=list(range(n)),
        prompt_len=prompt,
        loss_mask=[0] * prompt + [1] * len(versions),
        logprobs=[0.0] * n,
        versions=[-1] * prompt + versions,
        reward=1.0,
        masked=masked,
    )


def test_effective_sample_size_and_capped_fraction_per_level() -> None:
    # row 0 (level 0): rho 1 2 0 -> ESS (3)^2 / (3 * 5) = 0.6; row 1 (level 2): rho 1 1 -> 1
    rho = torch.tensor([[1.0, 2.0, 0.0], [1.0, 1.0, 9.0]])
    active = torch.tensor([[True, True, True], [True, True, False]])
    capped = torch.tensor([[False, True, True], [False, False, True]])
    sums = level_sums(
        rho=rho,
        log_ratio=torch.zeros_like(rho),
        capped=capped,
        active=active,
        levels=torch.tensor([0, 2]),
        n_levels=3,
    ).numpy()
    assert weight_metrics(sums[0])["is_ess"] == pytest.approx(0.6)
    assert weight_metrics(sums[0])["is_capped_fraction"] == pytest.approx(2 / 3)
    assert weight_metrics(sums[1]) == {}  # no tokens at level 1
    assert weight_metrics(sums[2])["is_ess"] == pytest.approx(1.0)
    assert weight_metrics(sums[2])["is_capped_fraction"] == 0.0  # the capped token is padding
    # all five tokens: rho 1 2 0 1 1, ESS 25 / (5 * 7) = 0.714286
    assert weight_metrics(sums.sum(0))["is_ess"] == pytest.approx(5 / 7)


def _ratio_sums(ratios: torch.Tensor) -> np.ndarray:
    """`level_sums` of one level whose tokens have these raw ratios and weight 1."""
    return level_sums(
        rho=torch.ones_like(ratios),
        log_ratio=ratios.log(),
        capped=torch.zeros_like(ratios, dtype=torch.bool),
        active=torch.ones_like(ratios, dtype=torch.bool),
        levels=torch.tensor([0]),
        n_levels=1,
    ).numpy()


def test_ratio_quantiles_to_one_percent() -> None:
    # 20 ratios: 18 at 1, one at 0.5, one at 4; p05 = the 1st of 20 = 0.5, p50 = 1, p95 = the 19th
    # = 1 (the 20th, 4, is above 95%)
    m = weight_metrics(_ratio_sums(torch.tensor([[0.5] + [1.0] * 18 + [4.0]]))[0])
    assert m["is_ratio_p05"] == pytest.approx(0.5, rel=0.01)
    assert m["is_ratio_p50"] == pytest.approx(1.0, abs=1e-12)  # 1 is a bin's centre
    assert m["is_ratio_p95"] == pytest.approx(1.0, abs=1e-12)
    # ratios beyond exp(+-3) land in the edge bins
    m = weight_metrics(_ratio_sums(torch.tensor([[1e-4, 1e4]]))[0])
    assert m["is_ratio_p05"] == pytest.approx(math.exp(-3), rel=0.01)
    assert m["is_ratio_p95"] == pytest.approx(math.exp(3), rel=0.01)


def test_token_weighted_staleness_and_tokens_off_the_first_version() -> None:
    # step 5. Group at version 3 (level 2): one trajectory sampled 3 3 4 4 (partial: resumed
    # under 4), one 3 3; a masked sample counts for nothing. Group at version 5 (level 0): 5 5 5.
    old = Group(
        id="a",
        prompt_id="p",
        version=3,
        samples=[_sample([3, 3, 4, 4]), _sample([3, 3]), _sample([9, 9], masked=True)],
    )
    new = Group(id="b", prompt_id="q", version=5, samples=[_sample([5, 5, 5])])
    sums = version_sums(5, [old, new], n_levels=3)
    # level 2: 6 tokens, staleness 2 2 1 1 2 2 = 10, 2 tokens off their first version (4 4)
    # (and 1 of its 2 trajectories spans versions)
    np.testing.assert_allclose(sums[2], [6, 10, 2, 1])
    np.testing.assert_allclose(sums[0], [3, 0, 0, 0])
    metrics = step_diagnostics(5, [old, new], np.zeros((3, 4 + 601)))
    assert metrics["staleness_tokens_mean"] == pytest.approx(10 / 9)
    assert metrics["off_first_version_fraction"] == pytest.approx(2 / 9)
    assert metrics["staleness2/staleness_tokens_mean"] == pytest.approx(10 / 6)
    assert metrics["staleness2/off_first_version_fraction"] == pytest.approx(2 / 6)
    assert metrics["staleness0/off_first_version_fraction"] == 0.0
    assert metrics["trajectories_spanning_versions"] == 1.0
    assert "staleness1/tokens" not in metrics


def test_the_loss_reports_the_raw_ratio_and_the_applied_weight() -> None:
    # ratios pi_prox / mu = 0.5 1 4 under tis (cap 2): rho 0.5 1 2, log ratio as sampled
    theta = torch.full((1, 3), math.log(0.5), requires_grad=True)
    proximal = theta.detach().clone()
    ratios = torch.tensor([[0.5, 1.0, 4.0]])
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=proximal - ratios.log(),
        proximal_logprobs=proximal,
        advantages=torch.tensor([1.0]),
        weights=torch.ones(1, 3),
        settings=LossSettings(off_policy="tis", tis_cap=2.0),
    )
    torch.testing.assert_close(out.rho, torch.tensor([[0.5, 1.0, 2.0]]))
    torch.testing.assert_close(out.log_ratio, ratios.log())
    assert out.capped.tolist() == [[False, False, True]]
