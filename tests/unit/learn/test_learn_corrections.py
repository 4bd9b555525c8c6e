"""The off-policy corrections of `learn.off_policy` (IcePop's token mask, MIS's sequence weight)
against values worked out by hand in the comments; `tis` and `decoupled` are in test_learn_loss."""

from __future__ import annotations

import math

import pytest
import torch

from dora.config import load_config
from dora.errors import ConfigError
from dora.learn.loss import LossSettings, policy_loss

HALF = math.log(0.5)


def _run(
    settings: LossSettings, ratios: list[list[float]], weights: list[list[float]] | None = None
) -> tuple[float, torch.Tensor, dict[str, float]]:
    """One step whose proximal policy is theta (first update: r = 1) and whose importance ratios
    pi_prox / mu are `ratios`; A = 2 on every row. (loss, grad of theta, stats)."""
    rho = torch.tensor(ratios)
    theta = torch.full(rho.shape, HALF, requires_grad=True)
    proximal = theta.detach().clone()
    out = policy_loss(
        logprobs=theta,
        behaviour_logprobs=proximal - rho.log(),
        proximal_logprobs=proximal,
        advantages=torch.full((rho.shape[0],), 2.0),
        weights=torch.ones(rho.shape) if weights is None else torch.tensor(weights),
        settings=settings,
    )
    out.loss_sum.backward()
    assert theta.grad is not None
    return out.loss_sum.item(), theta.grad, out.stats


def test_icepop_masks_tokens_whose_ratio_is_outside_the_band() -> None:
    # ratios 0.5 1 4 with the band [0.6, 3]: only the middle token keeps rho = 1; l = -2
    settings = LossSettings(off_policy="icepop", icepop_low=0.6, icepop_high=3.0)
    loss, grad, stats = _run(settings, [[0.5, 1.0, 4.0]])
    assert loss == pytest.approx(-2.0, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -2.0, 0.0]]))
    assert stats["is_capped"] == 2.0
    assert stats["is_weight_sum"] == pytest.approx(1.0, abs=1e-5)


def test_icepop_keeps_ratios_on_the_band_edges_unchanged() -> None:
    # band [0.5, 4] holds every ratio: rho = 0.5 1 4 as they are (no truncation); l = -2 * 5.5
    settings = LossSettings(off_policy="icepop", icepop_low=0.5, icepop_high=4.0)
    loss, grad, stats = _run(settings, [[0.5, 1.0, 4.0]])
    assert loss == pytest.approx(-11.0, abs=1e-4)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -2.0, -8.0]]))
    assert stats["is_capped"] == 0.0


def test_mis_geometric_mean_weight_is_truncated_per_sequence() -> None:
    # row 0: ratios 0.5 1 4, geometric mean 2 ** (1/3) = 1.259921, truncated at 1.2
    # row 1: ratios 2 2 and a padding token (weight 0, ratio 100, left out): mean 2 -> 1.2
    settings = LossSettings(off_policy="mis", mis_ratio="geometric", mis_high=1.2)
    loss, grad, stats = _run(settings, [[0.5, 1.0, 4.0], [2.0, 2.0, 100.0]], [[1, 1, 1], [1, 1, 0]])
    # l = -rho * A per token: -(1.2 * 2) * 5 tokens
    assert loss == pytest.approx(-12.0, abs=1e-4)
    torch.testing.assert_close(grad, torch.tensor([[-2.4, -2.4, -2.4], [-2.4, -2.4, 0.0]]))
    assert stats["is_capped"] == 5.0


def test_mis_geometric_mean_below_the_cap_is_the_weight() -> None:
    settings = LossSettings(off_policy="mis", mis_ratio="geometric", mis_high=2.0)
    loss, _, stats = _run(settings, [[0.5, 1.0, 4.0]])
    assert loss == pytest.approx(-2.0 * 3 * 2 ** (1 / 3), abs=1e-4)
    assert stats["is_capped"] == 0.0
    assert stats["is_weight_sum"] == pytest.approx(3 * 2 ** (1 / 3), abs=1e-4)


def test_mis_product_weight_truncated_or_masked() -> None:
    # product of ratios: row 0 0.5 * 1 * 4 = 2, row 1 1 * 1 * 1 = 1
    ratios = [[0.5, 1.0, 4.0], [1.0, 1.0, 1.0]]
    truncated = LossSettings(off_policy="mis", mis_ratio="product", mis_high=1.5)
    loss, grad, stats = _run(truncated, ratios)
    assert loss == pytest.approx(-2.0 * (3 * 1.5 + 3 * 1.0), abs=1e-4)  # 2 -> 1.5, 1 stays
    torch.testing.assert_close(grad, torch.tensor([[-3.0, -3.0, -3.0], [-2.0, -2.0, -2.0]]))
    assert stats["is_capped"] == 3.0
    masked = LossSettings(off_policy="mis", mis_ratio="product", mis_high=1.5, mis_action="mask")
    loss, grad, stats = _run(masked, ratios)
    assert loss == pytest.approx(-2.0 * 3, abs=1e-4)  # row 0 (2 > 1.5) dropped whole
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [-2.0, -2.0, -2.0]]))
    assert stats["is_capped"] == 3.0


def test_mis_low_threshold_masks_or_raises_a_sequence_weight() -> None:
    # product 0.5 * 1 * 1 = 0.5 under low = 0.8: masked -> 0, truncated -> raised to 0.8
    ratios = [[0.5, 1.0, 1.0]]
    common = {"off_policy": "mis", "mis_ratio": "product", "mis_low": 0.8, "mis_high": 2.0}
    loss, _, _ = _run(LossSettings(**common, mis_action="mask"), ratios)  # type: ignore[arg-type]
    assert loss == 0.0
    loss, _, _ = _run(LossSettings(**common, mis_action="truncate"), ratios)  # type: ignore[arg-type]
    assert loss == pytest.approx(-2.0 * 3 * 0.8, abs=1e-4)


def test_the_corrections_are_chosen_and_bounded_in_the_config() -> None:
    config = load_config(
        None,
        ["learn.off_policy=mis", "learn.mis.ratio=product", "learn.mis.action=mask"],
    )
    settings = LossSettings.from_config(config.learn)
    assert (settings.off_policy, settings.mis_ratio, settings.mis_action) == (
        "mis",
        "product",
        "mask",
    )
    assert LossSettings.from_config(load_config(None).learn) == LossSettings()  # tis, cap 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["learn.icepop.low=3", "learn.icepop.high=2"],
            r"learn\.icepop\.low = 3\.0 is invalid: it must be below learn\.icepop\.high = 2\.0",
        ),
        (
            ["learn.mis.low=2.5", "learn.mis.high=2"],
            r"learn\.mis\.low = 2\.5 is invalid: it must be below learn\.mis\.high = 2\.0",
        ),
        (["learn.icepop.low=-0.5"], r"learn\.icepop\.low = -0\.5 .*>= 0"),
        (["learn.mis.high=0"], r"learn\.mis\.high = 0 .*> 0"),
        (["learn.mis.high=nan"], r"learn\.mis\.high = nan is invalid: .*NaN"),
        (["learn.icepop.low=nan"], r"learn\.icepop\.low = nan is invalid: .*NaN"),
    ],
)
def test_nonsensical_thresholds_are_refused_naming_the_keys(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
