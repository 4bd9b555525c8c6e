"""The trainer's compute on groups of given lengths, outside a run: what `python -m dora.bench.cpu`
fits the simulator's training cost on, and what `dora bench trainer` times with and without
`learn.shared_prefix`.

A group here is `G` sequences of one prompt: the same random prompt tokens, then random answers
of the given lengths, loss on the answers only, exactly as the trainer receives a group from
serve. Each micro-batch runs the trainer's code: `plan_micro_batches`, `collate`, the model's
forward (`forward_logprobs`), the policy loss on the unpacked logprobs,
backward; then one clipped AdamW step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dora.config import DoraConfig
from dora.learn.batching import (
    MicroBatch,
    SequenceItem,
    collate,
    forward_logprobs,
    packs,
    plan_micro_batches,
    shared_prefix,
)
from dora.learn.loss import LossSettings, policy_loss, token_entropy

__all__ = ["TrainStep", "micro_batch_backward", "synthetic_group", "train_step"]


def synthetic_group(
    rng: np.random.Generator, *, vocab: int, prompt: int, answers: Sequence[int], gid: str = "g"
) -> list[SequenceItem]:
    """`len(answers)` sequences of one random `prompt`-token prompt and random answers."""
    head = rng.integers(0, vocab, size=prompt).astype(np.int32)
    items = []
    for n in answers:
        tokens = np.concatenate([head, rng.integers(0, vocab, size=n).astype(np.int32)])
        mask = np.zeros(len(tokens) - 1, dtype=np.float32)
        mask[max(0, prompt - 1) :] = 1.0
        items.append(
            SequenceItem(
                group_id=gid,
                tokens=tokens,
                loss_mask=mask,
                behaviour=np.full(len(tokens) - 1, -1.0, dtype=np.float32),
                advantage=float(rng.normal()),
                weight=1.0,
                norm=float(mask.sum()),
            )
        )
    return items


@dataclass
class TrainStep:
    """What one `train_step` ran: trained (loss) tokens, and tokens the model ran."""

    trained: int = 0
    run: int = 0


def micro_batch_backward(
    model: Any,
    items: Sequence[SequenceItem],
    *,
    packed: bool,
    settings: LossSettings,
    dtype: Any,
    temperature: float = 1.0,
) -> tuple[MicroBatch, Any, Any, float]:
    """The trainer's forward, policy loss and backward of one micro-batch of `items` (a packed
    row or padded rows) on the model's device: the micro-batch, its per-sequence logprobs, the
    logits of what the model ran, and the (unnormalised) loss."""
    mb = collate(items, pad_id=0, packed=packed).to(next(model.parameters()).device)
    logprobs, logits = forward_logprobs(model, mb, temperature=temperature, dtype=dtype)
    terms = policy_loss(
        logprobs=logprobs,
        behaviour_logprobs=mb.behaviour,
        proximal_logprobs=logprobs.detach(),
        advantages=mb.advantages,
        weights=mb.weights,
        settings=settings,
    )
    terms.loss_sum.backward()
    return mb, logprobs, logits, float(terms.loss_sum.detach())


def train_step(
    model: Any,
    optimizer: Any,
    groups: Sequence[list[SequenceItem]],
    *,
    config: DoraConfig,
    packed: bool,
) -> TrainStep:
    """One step of the trainer on `groups`, packed as `learn.shared_prefix` and
    `learn.shared_prefix_tokens` say, or padded."""
    import torch

    settings = LossSettings.from_config(config.learn)
    done = TrainStep()
    for items in groups:
        plan = plan_micro_batches(
            [it.length for it in items],
            world=1,
            budget=config.learn.micro_batch_tokens,
            shared=shared_prefix(items) if packed else None,
            row_cap=config.learn.shared_prefix_tokens,
        )
        cap = config.learn.shared_prefix_tokens if packed else None
        for indices in plan[0]:
            batch = [items[i] for i in indices]
            mb, _, logits, _ = micro_batch_backward(
                model,
                batch,
                packed=packs(batch, cap),
                settings=settings,
                dtype=torch.float32,
                temperature=config.rollout.temperature,
            )
            active = (mb.weights > 0).float()
            float((mb.unpack(token_entropy(logits)) * active).sum())
            done.trained += int(active.sum())
            done.run += int(logits.shape[0] * (logits.shape[1] + 1))
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.learn.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return done
