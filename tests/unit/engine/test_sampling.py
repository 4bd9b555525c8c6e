"""Vectorised counter-based sampling: determinism, truncation, distribution, logprobs."""

from __future__ import annotations

import pytest
import torch

from dora.engine.sampling import SamplingBatch, sample, sequence_key, uniform_noise

pytestmark = pytest.mark.timeout(30)


def batch(
    m: int, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, seed: int = 0
) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((m,), temperature),
        top_p=torch.full((m,), top_p),
        top_k=torch.full((m,), top_k, dtype=torch.int64),
        keys=torch.tensor([sequence_key(seed, i) for i in range(m)]),
        steps=torch.zeros(m, dtype=torch.int64),
    )


def test_noise_is_a_pure_function_of_key_step_and_token() -> None:
    keys, steps = torch.tensor([1, 2, 3]), torch.tensor([0, 5, 9])
    u = uniform_noise(keys, steps, 50)
    assert torch.equal(u, uniform_noise(keys, steps, 50))
    assert torch.equal(
        u[1:2], uniform_noise(keys[1:2], steps[1:2], 50)
    )  # independent of batch mates
    assert bool((u > 0).all() and (u < 1).all())
    assert not torch.equal(u[0], uniform_noise(keys[:1], steps[:1] + 1, 50)[0])


def test_greedy_top_k_1_and_tiny_top_p_pick_the_argmax() -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1)
    assert torch.equal(sample(logits, batch(8, temperature=0.0))[0], best)
    assert torch.equal(sample(logits, batch(8, top_k=1))[0], best)
    assert torch.equal(sample(logits, batch(8, top_p=1e-6))[0], best)


def test_logprobs_are_full_vocabulary_log_softmax_over_temperature() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    tokens, lps = sample(logits, batch(4, temperature=0.7, top_k=3))
    ref = torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(lps, ref, atol=1e-6)


def test_top_k_never_leaves_the_top_k() -> None:
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(2)).expand(400, 20)
    b = batch(400, top_k=3)
    tokens, _ = sample(logits, b)
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(tokens.tolist()) == allowed


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().expand(6000, 3)
    tokens, _ = sample(logits, batch(6000, seed=9))
    freq = torch.bincount(tokens, minlength=3).float() / 6000
    assert torch.allclose(freq, probs, atol=0.03)


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(200, 5)
    b = batch(200)
    b.banned = torch.zeros(200, 5, dtype=torch.bool)
    b.banned[:, 2] = True
    tokens, _ = sample(logits, b)
    assert 2 not in tokens.tolist()
