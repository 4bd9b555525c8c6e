"""Step metrics from reduced sums, worked out by hand."""

from __future__ import annotations

import pytest

from dora.learn.batching import prepare_group
from dora.learn.metrics import SUMS, step_metrics
from dora.protocol import Group, Sample


def _group(gid: str, version: int, rewards: list[float], masked: int = -1, turns: int = 1) -> Group:
    samples = [
        Sample.build(
            token_ids=[1, 2, 3],
            loss_mask=[0, 1, 1],
            logprobs=[0, -1, -1],
            versions=[-1, version, version],
            prompt_len=1,
            reward=r,
            masked=i == masked,
            reward_components={"task": r, "format": 0.5},
            num_turns=turns + i,
            num_tool_calls=i,
            metadata={"history_edits": str(i)},
        )
        for i, r in enumerate(rewards)
    ]
    return Group(id=gid, prompt_id="p", version=version, samples=samples)


def test_step_metrics() -> None:
    groups = [_group("a", 5, [1, 0]), _group("b", 3, [1, 1, 9], masked=2, turns=3)]
    prepared = [
        prepare_group(g, loss="grpo", aggregation="token", max_tokens=4, filter_zero_variance=True)
        for g in groups
    ]
    row = dict.fromkeys(SUMS, 0.0)
    # update 0: loss sum 2 over Z = 4; update 1: loss sum 3 over Z = 6 -> loss mean(0.5, 0.5)
    u0 = {**row, "loss": 2.0, "tokens": 4, "clipped": 1, "ratio_sum": 4.4, "entropy_sum": 8.0}
    u1 = {**row, "loss": 3.0, "tokens": 6, "clipped": 0, "ratio_sum": 5.6, "entropy_sum": 2.0}
    m = step_metrics(
        step=6,
        prepared=prepared,
        duplicates=2,
        sums=[[u0[k] for k in SUMS], [u1[k] for k in SUMS]],
        norms=[4.0, 6.0],
        ratio_max=1.3,
        ratio_min=0.8,
        grad_norms=[1.0, 3.0],
        ranks=2,
    )
    assert m["loss"] == pytest.approx(0.5)
    assert m["clip_fraction"] == pytest.approx(0.1)  # 1 of 10 tokens
    assert m["ratio_mean"] == pytest.approx(1.0) and m["entropy"] == pytest.approx(1.0)
    assert m["reward_mean"] == pytest.approx(0.75)  # 1, 0, 1, 1: the masked 9 is left out
    assert m["reward/task"] == pytest.approx(0.75) and m["reward/format"] == pytest.approx(0.5)
    assert m["turns_mean"] == pytest.approx((1 + 2 + 3 + 4) / 4)  # per unmasked episode
    assert m["tool_calls_mean"] == pytest.approx((0 + 1 + 0 + 1) / 4)
    assert m["history_edits"] == 2.0  # 0 + 1 + 0 + 1: the masked sample's 2 is left out
    assert (m["staleness_mean"], m["staleness_max"]) == (2.0, 3.0)  # 6 - 5 and 6 - 3
    assert (m["filtered_groups"], m["masked_samples"], m["duplicate_groups"]) == (1, 1, 2)
    assert (m["grad_norm"], m["version"], m["ranks"], m["tokens"]) == (2.0, 7.0, 2.0, 10.0)


def test_an_empty_step_has_no_nan() -> None:
    m = step_metrics(
        step=0,
        prepared=[],
        duplicates=0,
        sums=[[0.0] * len(SUMS)],
        norms=[0.0],
        ratio_max=0.0,
        ratio_min=float("inf"),
        grad_norms=[0.0],
        ranks=1,
    )
    assert all(v == v and abs(v) != float("inf") for v in m.values())
