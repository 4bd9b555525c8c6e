"""Attention over a packed row by its segments, instead of over the whole row under its 4D mask.

A packed row (`dora.learn.batching.pack_row`) holds a group's shared prefix once, then each
sequence's own tokens: `[0, b0)` the prefix, `[b0, b1)`, `[b1, b2)`, ... the sequences. A token of
a sequence sees the prefix and the earlier tokens of its own sequence, nothing else. Under the
dense mask, scaled dot-product attention still computes every query against every key of the row
(`L^2` scores, most of them masked, and the mask itself read in the forward and the backward
pass). By segments it computes what is seen only: the prefix causally, then each sequence's
queries against `[prefix; the sequence]`, `b0^2 / 2 + sum n_i (b0 + n_i)` scores. The result is
the same (up to float rounding: the softmax sums over the same keys in another order).

On the project's math workload (prompts of about 94 tokens, rows of up to 1,024 tokens) attention
was about a third of the trainer's CPU time under the dense mask (docs/trainer.md).

`use_segment_attention(model)` switches a model whose attention is `sdpa` to this function (it is
registered in Hugging Face's `AttentionInterface`); a micro-batch passes the row's segment bounds
as the `dora_segments` keyword of the model's forward (`MicroBatch.model_inputs`), which Hugging
Face models hand on to their attention function. Without bounds (padded micro-batches, the
reference model's rows when it was not switched), the function is plain `sdpa` on the dense mask.
A model with other attention (`eager`) keeps the dense mask: the segments would change nothing
but its speed, and its attention may do what `sdpa` does not (soft-capping).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

NAME = "dora_segments"
CHUNK_TOKENS = 64
KWARG = "dora_segments"


def use_segment_attention(model: Any) -> bool:
    """Switch `model` (a Hugging Face `PreTrainedModel` with `sdpa` attention) to attention by
    segments; False, and the model unchanged, when its attention is another."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, segment_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the model builds its masks as for sdpa
    model.set_attn_implementation(NAME)
    return bool(model.config._attn_implementation == NAME)


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dora_segments: tuple[int, ...] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function interface (`[B, heads, L, d]` in, `[B, L, heads, d]`
    out). `dora_segments`: the packed row's bounds `(b0, b1, ..., L)`, see the module docstring."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if dora_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1 or dora_segments[-1] != query.shape[2]:
        raise ValueError(
            f"segments {dora_segments} do not describe one row of {query.shape[2]} tokens "
            f"(batch of {query.shape[0]})"
        )
    kwargs.pop("is_causal", None)
    prefix = dora_segments[0]
    outputs = []
    if prefix:
        head = slice(0, prefix)
        out, _ = sdpa_attention_forward(
            module, query[:, :, head], key[:, :, head], value[:, :, head], None, is_causal=True,
            **kwargs,
        )  # fmt: skip
        outputs.append(out)
    for start, end, seen in _chunks(dora_segments, query.device):
        keys = torch.cat([key[:, :, :prefix], key[:, :, start:end]], dim=2)
        values = torch.cat([value[:, :, :prefix], value[:, :, start:end]], dim=2)
        out, _ = sdpa_attention_forward(
            module, query[:, :, start:end], keys, values, seen, is_causal=False, **kwargs
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


@functools.lru_cache(maxsize=8)
def _chunks(bounds: tuple[int, ...], device: torch.device) -> list[tuple[int, int, torch.Tensor]]:
    """Consecutive sequences grouped into chunks of about `CHUNK_TOKENS` (a longer sequence is a
    chunk of its own): `(start, end, mask)`, the mask `[1, 1, n, prefix + n]` True where a query
    of the chunk sees a key of `[prefix; chunk]`. One attention call per short sequence would
    cost more in calls than its few scores save. Every layer of a row asks for the same chunks:
    they are built once (the masks are only read)."""
    prefix = bounds[0]
    groups: list[list[int]] = []
    for start, end in itertools.pairwise(bounds):
        if end <= start:
            continue
        if groups and end - groups[-1][0] <= CHUNK_TOKENS:
            groups[-1].append(end)
        else:
            groups.append([start, end])
    chunks = []
    for edges in groups:
        start, end = edges[0], edges[-1]
        sizes = torch.tensor([b - a for a, b in itertools.pairwise(edges)])
        owner = torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(device)
        n = end - start
        seen = torch.ones(n, prefix + n, dtype=torch.bool, device=device)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        seen[:, prefix:] = causal & (owner[:, None] == owner[None, :])
        chunks.append((start, end, seen[None, None]))
    return chunks
