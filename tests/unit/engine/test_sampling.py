"""Vectorised counter-based sampling: determinism, truncation, distribution, logprobs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dora.engine.sampling import SamplingBatch, mix32, sample, sequence_key, uniform_noise

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


def test_noise_is_the_documented_hash_at_every_step() -> None:
    """u[i, v] is lowbias32 of (key, step, v) at any step, also past the step-hash table's first
    size (steps are looked up in a table that doubles as they grow)."""
    keys = torch.tensor([sequence_key(3, i) for i in range(4)])
    steps = torch.tensor([0, 1023, 1024, 5000])
    u = uniform_noise(keys, steps, 40)
    for i in range(4):
        row = mix32(int(keys[i]) ^ mix32(int(steps[i]) + 0x9E3779B9))
        for v in (0, 17, 39):
            bits = mix32(row ^ mix32(v * 0x632BE5AB + 0x85EBCA6B)) >> 8
            expected = (torch.tensor(bits, dtype=torch.float32) + 0.5) / (1 << 24)  # in float32
            assert float(u[i, v]) == float(expected)
    assert torch.equal(uniform_noise(keys, steps, 40, max_step=6000), u)


def test_what_the_caller_knows_changes_no_token_or_logprob() -> None:
    """Telling `sample` that no row is greedy or truncated, or a bound on the steps, only saves it
    looking: a batch mixing greedy, top-k, top-p and plain rows samples the same either way."""
    m = 12
    logits = torch.randn(m, 30, generator=torch.Generator().manual_seed(4))
    b = batch(m, seed=8)
    b.steps = torch.arange(m) * 300
    told = replace(b, any_greedy=False, any_truncation=False, max_step=4000)
    tokens, lps = sample(logits, b)
    assert torch.equal(tokens, sample(logits, told)[0])
    assert torch.equal(lps, sample(logits, told)[1])
    b.temperature[::3] = 0.0
    b.top_k[1::3] = 4
    b.top_p[2::3] = 0.6
    told = replace(b, any_greedy=True, any_truncation=True)
    tokens, lps = sample(logits, b)
    assert torch.equal(tokens, sample(logits, told)[0])
    assert torch.equal(lps, sample(logits, told)[1])
    assert torch.equal(tokens[::3], logits[::3].argmax(-1))
