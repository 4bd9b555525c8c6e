"""Advantages per group, packing to the token budget, equal micro-batch counts on every rank, and
exact normalisation however a step is split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.learn.batching import (
    SequenceItem,
    collate,
    is_zero_variance,
    pack,
    plan_micro_batches,
    prepare_group,
    split_over_ranks,
)
from dora.learn.loss import LossSettings, policy_loss
from dora.protocol import Group, Sample


def _sample(prompt: int, sampled: int, reward: float, *, masked: bool = False) -> Sample:
    n = prompt + sampled
    return Sample.build(
        token_ids=np.arange(n) % 50 + 7,
        loss_mask=[0] * prompt + [1] * sampled,
        logprobs=[0.0] * prompt + [-1.0] * sampled,
        versions=[-1] * prompt + [0] * sampled,
        prompt_len=prompt,
        reward=reward,
        masked=masked,
    )


def _group(rewards: list[float], sampled: list[int], gid: str = "g", **kw: bool) -> Group:
    masked = kw.get("masked_first", False)
    samples = [
        _sample(3, n, r, masked=masked and i == 0)
        for i, (r, n) in enumerate(zip(rewards, sampled, strict=True))
    ]
    return Group(id=gid, prompt_id="p", version=0, samples=samples)


def test_token_aggregation_weights_and_normaliser() -> None:
    g = prepare_group(
        _group([1, 0], [4, 2]),
        loss="grpo",
        aggregation="token",
        max_tokens=16,
        filter_zero_variance=False,
    )
    assert [(i.weight, i.norm) for i in g.items] == [(1.0, 4.0), (1.0, 2.0)]
    assert g.norm == 6.0
    # advantages of the whole group: +-0.5 / std(ddof=1) = +-0.7071
    assert [round(i.advantage, 4) for i in g.items] == [0.7071, -0.7071]
    # aligned to next-token targets: a 3-token prompt means 2 zeros first
    assert g.items[0].loss_mask.tolist() == [0, 0, 1, 1, 1, 1]


def test_sequence_aggregation_and_dr_grpo() -> None:
    seq = prepare_group(
        _group([1, 0], [4, 2]),
        loss="grpo",
        aggregation="sequence",
        max_tokens=16,
        filter_zero_variance=False,
    )
    assert [(i.weight, i.norm) for i in seq.items] == [(0.25, 1.0), (0.5, 1.0)]
    dr = prepare_group(
        _group([1, 0], [4, 2]),
        loss="dr_grpo",
        aggregation="sequence",
        max_tokens=16,
        filter_zero_variance=False,
    )
    assert [(i.weight, i.norm, i.advantage) for i in dr.items] == [(1, 16, 0.5), (1, 16, -0.5)]


def test_masked_samples_give_no_sequence_and_no_normaliser() -> None:
    g = prepare_group(
        _group([5, 1, 0], [4, 2, 2], masked_first=True),
        loss="grpo",
        aggregation="token",
        max_tokens=16,
        filter_zero_variance=False,
    )
    assert g.masked_samples == 1 and len(g.items) == 2 and g.norm == 4.0


def test_zero_variance_filter() -> None:
    flat = _group([1, 1, 1], [2, 2, 2])
    assert is_zero_variance(flat) and not is_zero_variance(_group([1, 0], [2, 2]))
    kept = prepare_group(
        flat, loss="grpo", aggregation="token", max_tokens=8, filter_zero_variance=False
    )
    assert not kept.filtered and all(i.advantage == 0 for i in kept.items)
    dropped = prepare_group(
        flat, loss="grpo", aggregation="token", max_tokens=8, filter_zero_variance=True
    )
    assert dropped.filtered and dropped.items == [] and dropped.norm == 0


def test_pack_first_fit_decreasing() -> None:
    # sorted 10 9 8 3 3, budget 20: [10, 9] (2 x 10), [8, 3] (2 x 8), [3] (3 x 8 > 20)
    assert pack([10, 9, 8, 3, 3], 20) == [[0, 1], [2, 3], [4]]
    assert pack([50, 3], 20) == [[0], [1]]  # a sequence over the budget runs alone


@given(st.lists(st.integers(1, 40), max_size=30), st.integers(16, 100))
@settings(max_examples=100, deadline=None)
def test_pack_respects_the_budget_and_keeps_every_sequence(lengths: list[int], budget: int) -> None:
    bins = pack(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget


def test_ranks_get_equal_counts_with_zero_weight_padding() -> None:
    # budget 10: rank 0 gets two 10-token rows (two micro-batches), rank 1 one and a padding one
    plan = plan_micro_batches([10, 10, 10], world=2, budget=10)
    assert plan == [[[0], [2]], [[1], []]]
    padding = collate([], pad_id=0)
    assert padding.input_ids.shape == (1, 2) and not padding.weights.any()


@given(st.lists(st.integers(2, 40), min_size=1, max_size=20), st.integers(1, 4))
@settings(max_examples=100, deadline=None)
def test_plan_is_equal_across_ranks_and_complete(lengths: list[int], world: int) -> None:
    plan = plan_micro_batches(lengths, world=world, budget=48)
    assert len({len(p) for p in plan}) == 1
    assert sorted(i for p in plan for mb in p for i in mb) == list(range(len(lengths)))
    shares = split_over_ranks(lengths, world)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)


def test_streamed_micro_batches_reproduce_the_whole_step_loss_and_gradient() -> None:
    """Sum of unnormalised micro-batch losses / Z == the loss of the whole step at once."""
    rng = np.random.default_rng(0)
    groups = [
        _group(list(rng.random(4)), list(rng.integers(1, 9, 4)), gid=f"g{k}") for k in range(3)
    ]
    prepared = [
        prepare_group(
            g, loss="grpo", aggregation="sequence", max_tokens=8, filter_zero_variance=False
        )
        for g in groups
    ]
    items = [i for p in prepared for i in p.items]
    z = sum(p.norm for p in prepared)
    table = torch.nn.Embedding(60, 1)
    s = LossSettings(off_policy="none")

    def loss_of(batch_items: list[SequenceItem]) -> torch.Tensor:
        mb = collate(batch_items, pad_id=0)
        logprobs = -torch.nn.functional.softplus(table(mb.targets).squeeze(-1))
        terms = policy_loss(
            logprobs=logprobs,
            behaviour_logprobs=mb.behaviour,
            advantages=mb.advantages,
            weights=mb.weights,
            settings=s,
        )
        return terms.loss_sum

    whole = loss_of(items) / z
    whole.backward()
    assert table.weight.grad is not None
    expected = table.weight.grad.clone()
    table.weight.grad = None
    streamed = torch.zeros(())
    for p in prepared:  # groups arrive one by one, split over 2 ranks, packed to 20 tokens
        plan = plan_micro_batches([i.length for i in p.items], world=2, budget=20)
        for rank_plan in plan:
            for mb in rank_plan:
                part = loss_of([p.items[i] for i in mb])
                part.backward()
                streamed = streamed + part.detach()
    table.weight.grad /= z
    assert (streamed / z).item() == pytest.approx(whole.item(), abs=1e-6)
    torch.testing.assert_close(table.weight.grad, expected)
