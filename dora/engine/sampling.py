"""Vectorised sampling for a batch of sequences: one call per decode step, no per-row Python.

Randomness is counter-based, not a stateful `torch.Generator`: the noise for sequence `s` at output
position `t` over vocabulary entry `v` is a hash of (key(s), t, v). So
- a batch samples with one tensor expression, whatever mix of seeds it holds;
- a seeded request draws the same tokens whether it runs alone or beside 63 others;
- the whole "RNG state" of a request is its 64-bit key and the number of tokens it has sampled,
  which is what request export carries, so a migrated request continues exactly where it left off.

Sampling is Gumbel-max: `argmax(logits / T + g)` with `g = -log(-log(u))` picks token v with
probability `softmax(logits / T)[v]`; top-k and top-p mask logits to -inf before it. Temperature 0
is greedy.

Behaviour logprobs are `log_softmax(logits / T)` over the whole vocabulary (T = 1 when greedy),
taken *before* top-k/top-p truncation and before `min_tokens` bans, in float32: this is
what the trainer recomputes.

The hash is `lowbias32` (Chris Wellons) on int64 tensors holding 32-bit values: products may wrap
past 2**63, but only the low 32 bits are kept, which wrapping preserves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def mix32(x: int) -> int:
    """The lowbias32 hash of a Python int (its low 32 bits)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 hash of every element of an int64 tensor (its low 32 bits)."""
    x = x & _M32  # a new tensor: the rest works in place on it
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x846CA68B).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def sequence_key(seed: int, index: int = 0) -> int:
    """The 32-bit noise key of output sequence `index` of a request seeded with `seed`."""
    seed &= (1 << 64) - 1
    return mix32(mix32(mix32(seed >> 32) ^ (seed & _M32)) ^ mix32(index + _GOLDEN))


def uniform_noise(
    keys: torch.Tensor, steps: torch.Tensor, vocab_size: int, max_step: int | None = None
) -> torch.Tensor:
    """u in (0, 1), shape [rows, vocab], a pure function of (keys[i], steps[i], v).
    `max_step`: a bound on `steps` if the caller knows one (saves looking)."""
    if max_step is None:
        max_step = int(steps.max()) if steps.numel() else 0
    row = mix32_tensor(keys ^ _step_hash(max_step, keys.device)[steps])
    col = _column_hash(vocab_size, keys.device)
    bits = mix32_tensor(row[:, None] ^ col[None, :]) >> 8  # 24 bits: exact in float32
    return bits.to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24))


@functools.lru_cache(maxsize=8)
def _column_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    """The per-vocabulary-entry half of the noise hash: the same at every step, so made once
    per device."""
    with torch.inference_mode(False):
        cols = torch.arange(vocab_size, dtype=torch.int64, device=device)
        return mix32_tensor(cols * 0x632BE5AB + 0x85EBCA6B)


@functools.lru_cache(maxsize=4)
def _step_hash_table(size: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        return mix32_tensor(torch.arange(size, dtype=torch.int64, device=device) + _GOLDEN)


def _step_hash(max_step: int, device: torch.device) -> torch.Tensor:
    """The per-step half of a row's noise hash for steps `[0, max_step]`, as a table: a decode
    step looks its rows' up instead of hashing them (the table doubles as steps grow)."""
    size = 1024
    while size <= max_step:
        size *= 2
    return _step_hash_table(size, device)


@dataclass
class SamplingBatch:
    """Per-row sampling settings of the rows being sampled, as tensors (rows first)."""

    temperature: torch.Tensor  # float32 [m]; 0 means greedy
    top_p: torch.Tensor  # float32 [m]; 1 means off
    top_k: torch.Tensor  # int64 [m]; <= 0 means off
    keys: torch.Tensor  # int64 [m], 32-bit noise keys
    steps: torch.Tensor  # int64 [m], tokens sampled so far
    banned: torch.Tensor | None = None  # bool [m, vocab]: tokens that may not be sampled now
    any_greedy: bool | None = None
    """Whether some row is greedy, if the caller knows (None: look at `temperature`)."""
    any_truncation: bool | None = None
    """Whether some row has top-k or top-p, if the caller knows (None: look)."""
    max_step: int | None = None
    """A bound on `steps`, if the caller knows one (None: look)."""


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token ids int64 [m], behaviour logprobs float32 [m])."""
    logits = logits.float()
    greedy = _greedy_rows(batch)
    temp = batch.temperature
    if greedy is not None:
        temp = torch.where(greedy, torch.ones_like(temp), temp)
    scaled = logits / temp[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    scores = scaled
    if batch.banned is not None:
        scores = scores.masked_fill(batch.banned, float("-inf"))
    truncation = batch.any_truncation
    if truncation is None:
        truncation = bool(((batch.top_k > 0) | (batch.top_p < 1)).any())
    if truncation:
        scores = _truncate(scores, batch.top_k, batch.top_p)
    # scores + g with Gumbel noise g = -log(-log(u)), computed in place on the noise tensor
    minus_gumbel = uniform_noise(batch.keys, batch.steps, logits.shape[-1], batch.max_step)
    noisy = scores - minus_gumbel.log_().neg_().log_()
    if greedy is not None:
        noisy = torch.where(greedy[:, None], scores, noisy)
    tokens = noisy.argmax(dim=-1)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def _greedy_rows(batch: SamplingBatch) -> torch.Tensor | None:
    """The mask of greedy rows (temperature 0), or None when no row is greedy."""
    if batch.any_greedy is False:
        return None
    greedy = batch.temperature <= 0
    if batch.any_greedy is None and not bool(greedy.any()):
        return None
    return greedy


def _truncate(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus to -inf (the best token stays)."""
    vocab = scores.shape[-1]
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scores.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = rank >= k[:, None]
    probs = torch.softmax(sorted_scores.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
    drop |= (before >= top_p[:, None]) & (rank > 0)
    drop_unsorted = torch.zeros_like(drop).scatter(1, order, drop)
    return scores.masked_fill(drop_unsorted, float("-inf"))
