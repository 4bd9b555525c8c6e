"""From assigned groups to packed micro-batches, identically on every rank: pure code, no I/O.

Invariants:
- Advantages are computed per group, over the whole group, *before* any split (`prepare_group`), so
  a group split across micro-batches or ranks trains on the same advantages as an unsplit one.
- Every sequence carries its aggregation weight `w` and its share `norm` of the step normaliser
  `Z` (see `dora.learn.loss`), so `Z` is a plain sum over the sequences of an update, whatever the
  arrival order and the rank split.
- `plan_micro_batches` is deterministic (every rank computes the same plan from the same group)
  and gives every rank the same number of micro-batches, padding with empty (zero-weight) ones, so a
  collective never waits for a rank that has nothing left to run.
- Micro-batches are rows padded to their longest row; the budget `micro_batch_tokens` bounds
  `rows * longest` (what the forward really costs). A single sequence longer than the budget gets a
  micro-batch of its own.
- Masked samples (failed episodes) and samples without sampled tokens stay in the group's metrics
  but produce no sequence: they contribute no gradient and nothing to `Z`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from dora.learn.loss import LossKind, group_advantages
from dora.protocol import Group

Aggregation = Literal["token", "sequence"]


@dataclass(frozen=True, kw_only=True)
class SequenceItem:
    """One sample ready for the loss. Arrays are aligned to next-token targets (length n - 1)."""

    group_id: str
    tokens: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.float32]
    behaviour: npt.NDArray[np.float32]
    advantage: float
    weight: float
    norm: float
    proximal: npt.NDArray[np.float32] | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, kw_only=True)
class PreparedGroup:
    """A group after advantages and filtering; `items` is empty when it was filtered."""

    group: Group
    items: list[SequenceItem]
    filtered: bool
    masked_samples: int

    @property
    def norm(self) -> float:
        return sum(item.norm for item in self.items)


def is_zero_variance(group: Group) -> bool:
    """All unmasked rewards equal (or fewer than two of them): no learning signal."""
    rewards = [s.reward for s in group.samples if not s.masked]
    return len(rewards) < 2 or max(rewards) == min(rewards)


def prepare_group(
    group: Group,
    *,
    loss: LossKind,
    aggregation: Aggregation,
    max_tokens: int,
    filter_zero_variance: bool,
) -> PreparedGroup:
    """Advantages over the whole group, then one `SequenceItem` per sample that has loss tokens.

    `max_tokens` is Dr. GRPO's constant normaliser per sequence (the generation budget).
    """
    masked = sum(1 for s in group.samples if s.masked)
    if filter_zero_variance and is_zero_variance(group):
        return PreparedGroup(group=group, items=[], filtered=True, masked_samples=masked)
    advantages = group_advantages(
        [s.reward for s in group.samples],
        [not s.masked for s in group.samples],
        scale=loss != "dr_grpo",
    )
    items: list[SequenceItem] = []
    for sample, advantage in zip(group.samples, advantages, strict=True):
        if sample.masked:
            continue
        mask = sample.mask()[1:].astype(np.float32)
        n = float(mask.sum())
        if n == 0:
            continue
        if loss == "dr_grpo":
            weight, norm = 1.0, float(max_tokens)
        elif aggregation == "sequence":
            weight, norm = 1.0 / n, 1.0
        else:
            weight, norm = 1.0, n
        items.append(
            SequenceItem(
                group_id=group.id,
                tokens=sample.tokens(),
                loss_mask=mask,
                behaviour=sample.behaviour_logprobs()[1:],
                advantage=float(advantage),
                weight=weight,
                norm=norm,
            )
        )
    return PreparedGroup(group=group, items=items, filtered=False, masked_samples=masked)


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: indices into `lengths`, so that rows * longest <= budget per bin."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    longest: list[int] = []
    for i in order:
        for b, members in enumerate(bins):
            if (len(members) + 1) * longest[b] <= budget:
                members.append(i)
                break
        else:
            bins.append([i])
            longest.append(lengths[i])
    return bins


def split_over_ranks(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Longest first, each to the rank with the fewest tokens so far (ties: the lowest rank)."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda k: (load[k], k))
        shares[r].append(i)
        load[r] += lengths[i]
    return shares


def plan_micro_batches(lengths: Sequence[int], *, world: int, budget: int) -> list[list[list[int]]]:
    """plan[rank] = that rank's micro-batches (indices into `lengths`); every rank gets the same
    number, the missing ones empty (zero-weight padding)."""
    plan: list[list[list[int]]] = []
    for share in split_over_ranks(lengths, world):
        bins = pack([lengths[i] for i in share], budget)
        plan.append([[share[j] for j in b] for b in bins])
    count = max(len(p) for p in plan)
    for p in plan:
        p.extend([] for _ in range(count - len(p)))
    return plan


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """Padded tensors of one micro-batch; targets are `input_ids[:, 1:]`."""

    input_ids: torch.Tensor  # [N, T] int64
    behaviour: torch.Tensor  # [N, T - 1]
    proximal: torch.Tensor | None  # [N, T - 1], when every item carries one
    advantages: torch.Tensor  # [N]
    weights: torch.Tensor  # [N, T - 1]: w on loss tokens, 0 elsewhere

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, 1:]

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch on `device` (the trainer's accelerator)."""
        if device.type == "cpu":
            return self
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            behaviour=self.behaviour.to(device),
            proximal=None if self.proximal is None else self.proximal.to(device),
            advantages=self.advantages.to(device),
            weights=self.weights.to(device),
        )


def collate(items: Sequence[SequenceItem], *, pad_id: int) -> MicroBatch:
    """Right-pad `items` into one micro-batch; no items gives a 1 x 2 zero-weight batch."""
    if not items:
        return MicroBatch(
            input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
            behaviour=torch.zeros(1, 1),
            proximal=torch.zeros(1, 1),
            advantages=torch.zeros(1),
            weights=torch.zeros(1, 1),
        )
    width = max(item.length for item in items)
    n = len(items)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    behaviour = torch.zeros(n, width - 1)
    weights = torch.zeros(n, width - 1)
    have_prox = all(item.proximal is not None for item in items)
    proximal = torch.zeros(n, width - 1) if have_prox else None
    for row, item in enumerate(items):
        k = item.length
        ids[row, :k] = torch.from_numpy(item.tokens.astype(np.int64))
        behaviour[row, : k - 1] = torch.from_numpy(item.behaviour.copy())
        weights[row, : k - 1] = torch.from_numpy(item.loss_mask * np.float32(item.weight))
        if proximal is not None and item.proximal is not None:
            proximal[row, : k - 1] = torch.from_numpy(item.proximal)
    advantages = torch.tensor([item.advantage for item in items], dtype=torch.float32)
    return MicroBatch(
        input_ids=ids,
        behaviour=behaviour,
        proximal=proximal,
        advantages=advantages,
        weights=weights,
    )
