"""Packed micro-batches: a group's sequences in one row, their prompt once, under a 4D mask."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_lm import small_lm
from transformers import AttentionInterface

from dora.learn import segment_attention
from dora.learn.batching import (
    SequenceItem,
    collate,
    forward_logprobs,
    pack,
    packing_refusal,
    packs,
    plan_micro_batches,
    shared_prefix,
)
from dora.learn.loss import LossSettings, policy_loss
from dora.learn.segment_attention import use_segment_attention

VOCAB = 24


def _item(tokens: list[int], prompt: int, advantage: float = 1.0) -> SequenceItem:
    n = len(tokens)
    mask = np.zeros(n - 1, dtype=np.float32)
    mask[prompt - 1 :] = 1.0  # targets from the first sampled token on
    return SequenceItem(
        group_id="g",
        tokens=np.array(tokens, dtype=np.int32),
        loss_mask=mask,
        behaviour=np.full(n - 1, -2.0, dtype=np.float32),
        advantage=advantage,
        weight=1.0,
        norm=float(mask.sum()),
    )


def _model(attention: str, arch: str = "llama") -> torch.nn.Module:
    """`attention` "segments": sdpa switched to attention by segments, as the trainer's."""
    impl = "sdpa" if attention == "segments" else attention
    model = small_lm(arch, attn_implementation=impl, num_key_value_heads=2)
    if attention == "segments":
        assert use_segment_attention(model)
    return model


def _loss(model: torch.nn.Module, items: list[SequenceItem], *, packed: bool) -> torch.Tensor:
    mb = collate(items, pad_id=0, packed=packed)
    logprobs = forward_logprobs(model, mb, temperature=1.0, dtype=torch.float32)[0]
    return policy_loss(
        logprobs=logprobs,
        behaviour_logprobs=mb.behaviour,
        advantages=mb.advantages,
        weights=mb.weights,
        settings=LossSettings(off_policy="none"),
    ).loss_sum


def _logprobs(model: torch.nn.Module, items: list[SequenceItem], *, packed: bool) -> torch.Tensor:
    mb = collate(items, pad_id=0, packed=packed)
    with torch.no_grad():
        return forward_logprobs(model, mb, temperature=1.0, dtype=torch.float32)[0]


GROUP = [  # a 9-token prompt; two answers start alike, one is a single token
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 4, 2],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 17, 18, 19, 2],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 2],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 20, 21, 22, 23, 13, 14, 2],
]


@pytest.mark.parametrize(
    ("attention", "arch"),
    [("sdpa", "llama"), ("eager", "qwen2"), ("segments", "llama"), ("segments", "qwen2")],
)
def test_a_packed_row_gives_every_sequence_its_own_logprobs_and_gradient(
    attention: str, arch: str
) -> None:
    model = _model(attention, arch)
    advantages = [1.0, -0.5, 2.0, -1.0]
    items = [_item(t, prompt=9, advantage=a) for t, a in zip(GROUP, advantages, strict=True)]
    mb = collate(items, pad_id=0, packed=True)
    assert mb.packed is not None
    # the prompt's first 8 tokens once (the 9th starts every sequence's own part), then the rest
    assert mb.packed.input_ids.shape[1] == 8 + sum(len(t) - 8 for t in GROUP)

    padded = _loss(model, items, packed=False)
    padded.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    packed = _loss(model, items, packed=True)
    packed.backward()

    assert packed.item() == pytest.approx(padded.item(), abs=1e-5)
    for name, param in model.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(param.grad, expected[name], atol=1e-5, rtol=1e-4)
    trained = mb.weights > 0
    torch.testing.assert_close(
        _logprobs(model, items, packed=True)[trained],
        _logprobs(model, items, packed=False)[trained],
        atol=1e-5,
        rtol=1e-5,
    )


@st.composite
def _groups(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    prompt = draw(st.integers(2, 10))
    head = draw(st.lists(st.integers(1, VOCAB - 1), min_size=prompt, max_size=prompt))
    answers = draw(
        st.lists(
            st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=8), min_size=1, max_size=5
        )
    )
    return [head + a for a in answers], prompt


@given(_groups())
@settings(max_examples=25, deadline=None)
def test_every_target_a_packed_row_computes_is_the_sequences_own(
    group: tuple[list[list[int]], int],
) -> None:
    """Wherever the unpacked logprobs are not the 0 of 'no target', they equal the padded
    forward's; and every trained target has one."""
    sequences, prompt = group
    items = [_item(t, prompt=prompt) for t in sequences]
    mb = collate(items, pad_id=0, packed=True)
    for attention in ("sdpa", "segments"):
        model = _model(attention)
        packed = _logprobs(model, items, packed=True)
        padded = _logprobs(model, items, packed=False)
        computed = (
            mb.packed.index >= 0
            if mb.packed is not None
            else torch.ones_like(packed, dtype=torch.bool)
        )
        assert bool(computed[mb.weights > 0].all())
        torch.testing.assert_close(packed[computed], padded[computed], atol=1e-5, rtol=1e-5)


def test_attention_by_segments_runs_each_chunk_of_a_packed_row_against_the_prefix_and_itself() -> (
    None
):
    """Long and short answers mixed: short ones share a chunk, a long one is a chunk of its
    own; every attention call of a packed row sees the row's bounds, and the loss and the
    gradient are the padded ones."""
    calls: list[tuple[int, ...] | None] = []
    real = segment_attention.segment_attention

    def spy(*args: Any, dora_segments: tuple[int, ...] | None = None, **kwargs: Any) -> Any:
        calls.append(dora_segments)
        return real(*args, dora_segments=dora_segments, **kwargs)

    model = _model("segments")
    AttentionInterface.register(segment_attention.NAME, spy)
    try:
        _check_segments_against_padded(model, calls)
    finally:
        AttentionInterface.register(segment_attention.NAME, real)


def _check_segments_against_padded(
    model: torch.nn.Module, calls: list[tuple[int, ...] | None]
) -> None:
    head = [1 + i % 7 for i in range(12)]
    answers = [[8 + (k * 5 + i) % 50 for i in range(n)] for k, n in enumerate([70, 3, 5, 90, 2])]
    items = [_item(head + a, prompt=12, advantage=k - 2.0) for k, a in enumerate(answers)]
    mb = collate(items, pad_id=0, packed=True)
    assert mb.packed is not None
    assert mb.packed.bounds == (11, 82, 86, 92, 183, 186)
    chunks = [
        (a, b) for a, b, _ in segment_attention._chunks(mb.packed.bounds, torch.device("cpu"))
    ]
    assert chunks == [(11, 82), (82, 92), (92, 183), (183, 186)]

    padded = _loss(model, items, packed=False)
    padded.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    calls.clear()
    packed = _loss(model, items, packed=True)
    packed.backward()
    assert calls == [mb.packed.bounds] * 2  # one call per layer, with the row's bounds
    assert packed.item() == pytest.approx(padded.item(), abs=1e-5)
    for name, param in model.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(param.grad, expected[name], atol=1e-5, rtol=1e-4)


def test_only_sdpa_attention_is_switched_to_segments() -> None:
    eager = small_lm("qwen2", attn_implementation="eager")
    assert not use_segment_attention(eager)
    assert eager.config._attn_implementation == "eager"
    sdpa = small_lm("llama", attn_implementation="sdpa")
    assert use_segment_attention(sdpa)
    assert packing_refusal(sdpa.config, 8192) is None


def test_the_shared_prefix_stops_where_the_sequences_part_or_training_starts() -> None:
    a = _item([1, 2, 3, 4, 5, 6], prompt=4)
    b = _item([1, 2, 3, 4, 7], prompt=4)
    assert shared_prefix([a, b]) == 3  # the 4th token starts each sequence's part: it predicts
    assert shared_prefix([a, _item([1, 2, 9, 4, 7], prompt=4)]) == 2  # prompts part at the 3rd
    assert shared_prefix([a, _item([1, 2, 3, 4, 5, 6, 8], prompt=6)]) == 3  # the earliest trained
    assert shared_prefix([a]) == 0


@given(st.lists(st.integers(4, 40), max_size=30), st.integers(3, 3), st.integers(16, 100))
@settings(max_examples=100, deadline=None)
def test_packed_bins_keep_within_the_budget_and_keep_every_sequence(
    lengths: list[int], shared: int, budget: int
) -> None:
    bins = pack(lengths, budget, shared=shared)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) == 1 or shared + sum(lengths[i] - shared for i in b) <= budget
    plan = plan_micro_batches(lengths or [4], world=2, budget=budget, shared=shared)
    assert len({len(p) for p in plan}) == 1


def _group(prompt: int, answers: list[int]) -> list[SequenceItem]:
    head = [1 + i % 7 for i in range(prompt)]
    return [_item(head + [8 + k % 9] * n, prompt=prompt) for k, n in enumerate(answers)]


@given(
    st.integers(2, 60),
    st.lists(st.integers(1, 120), min_size=1, max_size=12),
    st.integers(16, 400),
    st.integers(16, 400),
    st.integers(1, 3),
)
@settings(max_examples=150, deadline=None)
def test_a_group_packs_only_into_rows_within_the_cap_and_never_into_more_micro_batches(
    prompt: int, answers: list[int], budget: int, cap: int, world: int
) -> None:
    items = _group(prompt, answers)
    lengths = [it.length for it in items]
    shared = shared_prefix(items)
    plan = plan_micro_batches(lengths, world=world, budget=budget, shared=shared, row_cap=cap)
    padded = plan_micro_batches(lengths, world=world, budget=budget)
    assert sorted(i for p in plan for b in p for i in b) == list(range(len(items)))
    assert len({len(p) for p in plan}) == 1
    assert len(plan[0]) <= len(padded[0])
    for p in plan:
        for b in p:
            batch = [items[i] for i in b]
            row = shared + sum(it.length - shared for it in batch)
            assert packs(batch, cap) == (len(batch) > 1 and row <= cap)
            assert not packs(batch, None)


def test_a_group_of_long_answers_trains_padded_and_one_of_short_answers_packed() -> None:
    """The packed row attends over its whole length under its mask (its cost grows with the
    square of the row), so long answers go padded: measured 0.32x (CPU) and 0.43x (H200) at
    answers of about 750 tokens in one packed row, 1.3-1.6x at about 50."""
    short = _group(94, [47, 30, 60, 45, 52, 38, 41, 49])
    lengths = [it.length for it in short]
    plan = plan_micro_batches(lengths, world=1, budget=8192, shared=93, row_cap=1024)
    assert sorted(plan[0][0]) == list(range(8))  # one packed row of 455 tokens
    assert packs([short[i] for i in plan[0][0]], 1024)
    long = _group(256, [750, 700, 800, 760, 730, 690, 710, 780])
    lengths = [it.length for it in long]
    plan = plan_micro_batches(lengths, world=1, budget=8192, shared=255, row_cap=1024)
    # padded: 7 rows then 1 within 8192 tokens, not 8 micro-batches of one answer each
    assert plan == plan_micro_batches(lengths, world=1, budget=8192)
    assert [len(b) for b in plan[0]] == [7, 1]
    assert not packs([long[i] for i in plan[0][0]], 1024)


def test_packing_is_refused_where_a_row_would_not_compute_each_sequence_alone() -> None:
    assert packing_refusal(small_lm("llama", attn_implementation="sdpa").config, 8192) is None
    assert packing_refusal(small_lm("qwen2", attn_implementation="eager").config, 8192) is None
    sliding = small_lm(
        "qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=0
    ).config
    assert "sliding window of 64" in str(packing_refusal(sliding, 128))
    assert packing_refusal(sliding, 64) is None  # no sequence is longer than the window
    flash = SimpleNamespace(_attn_implementation="flash_attention_2")
    assert "ignores a 4D attention mask" in str(packing_refusal(flash, 8192))
    linear = SimpleNamespace(layer_types=["full_attention", "linear_attention"])
    assert "do not all take" in str(packing_refusal(linear, 8192))
