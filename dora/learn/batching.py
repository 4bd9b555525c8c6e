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
- With `learn.shared_prefix` (the default) a micro-batch is one packed row: the leading tokens
  every sequence of the group shares (its prompt, `shared_prefix`) once, then each sequence's
  own tokens, under a 4D attention mask that lets a sequence see the prefix and itself only, with
  its own positions. The model computes exactly what it computes on each sequence alone; the
  prompt runs once for the group instead of once per sample. A packed row is at most
  `shared_prefix_tokens` long (its masked attention grows with the square of its length), and a
  group that would need more packed rows than padded micro-batches trains padded. Without it,
  micro-batches are one sequence per row, padded to the longest, and the budget
  `micro_batch_tokens` bounds `rows * longest`. Either way a single sequence longer than the
  budget gets a micro-batch of its own, and the loss sees per-sequence tensors
  (`MicroBatch.unpack`).
- Masked samples (failed episodes) and samples without sampled tokens stay in the group's metrics
  but produce no sequence: they contribute no gradient and nothing to `Z`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from dora.learn.loss import LossKind, group_advantages, token_logprobs
from dora.learn.segment_attention import KWARG as SEGMENTS_KWARG
from dora.learn.segment_attention import NAME as SEGMENT_ATTENTION
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
    version: int = 0  # its group's version (the staleness level of the diagnostics)

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
                version=group.version,
            )
        )
    return PreparedGroup(group=group, items=items, filtered=False, masked_samples=masked)


def shared_prefix(items: Sequence[SequenceItem]) -> int:
    """How many leading tokens a packed row holds once for all of `items`: the tokens they all
    share, up to the position of the first trained target of any of them (so that every trained
    token is predicted inside its own sequence's part of the row). 0 for fewer than two items."""
    if len(items) < 2:
        return 0
    first = items[0].tokens
    common = min(_first_trained(item) for item in items)
    for item in items[1:]:
        n = min(common, len(item.tokens))
        differ = np.flatnonzero(first[:n] != item.tokens[:n])
        common = int(differ[0]) if len(differ) else n
    return common


def _first_trained(item: SequenceItem) -> int:
    trained = np.flatnonzero(item.loss_mask)
    return int(trained[0]) if len(trained) else len(item.loss_mask)


def packing_refusal(model_config: Any, longest: int) -> str | None:
    """Why a packed row would not compute, for every sequence of up to `longest` tokens, what the
    model computes on it alone; None when it does. A packed row's 4D mask is full causal attention
    within each sequence: attention that ignores 4D masks, layers that are not plain attention,
    and sliding windows shorter than a sequence are out."""
    attention = getattr(model_config, "_attn_implementation", None) or "eager"
    if attention not in ("eager", "sdpa", SEGMENT_ATTENTION):
        return f"{attention!r} attention ignores a 4D attention mask"
    kinds = set(getattr(model_config, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention", "sliding_attention"}:
        return f"layers of kinds {sorted(kinds)} do not all take a 4D attention mask"
    window = getattr(model_config, "sliding_window", None)
    slides = "sliding_attention" in kinds or getattr(model_config, "use_sliding_window", True)
    if window and slides and window < longest:
        return (
            f"its sliding window of {window} tokens is shorter than a sequence may be "
            f"(model.max_model_len = {longest}), and a packed row's mask does not slide"
        )
    return None


def pack(lengths: Sequence[int], budget: int, *, shared: int | None = None) -> list[list[int]]:
    """First-fit decreasing: indices into `lengths`, binned within `budget` tokens. `shared` None:
    padded rows, `rows * longest <= budget`; `shared = s`: one packed row holding the first `s`
    tokens once, `s + sum(n - s) <= budget`."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    cost: list[int] = []
    for i in order:
        n = lengths[i]
        for b, members in enumerate(bins):
            # decreasing order: a padded bin's longest row is its first
            grown = cost[b] + n - shared if shared is not None else (len(members) + 1) * cost[b]
            if grown <= budget:
                members.append(i)
                if shared is not None:
                    cost[b] = grown
                break
        else:
            bins.append([i])
            cost.append(n)
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


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    world: int,
    budget: int,
    shared: int | None = None,
    row_cap: int | None = None,
) -> list[list[list[int]]]:
    """plan[rank] = that rank's micro-batches (indices into `lengths`); every rank gets the same
    number, the missing ones empty (zero-weight padding).

    Padded bins within `budget`; with `shared` (the group's `shared_prefix`), packed rows of at
    most `min(budget, row_cap)` tokens instead, where that takes no more micro-batches than
    padding does (a group whose answers are too long to share rows trains padded, `packs`)."""
    padded = _plan(lengths, world, budget, None)
    if shared is None:
        return padded
    packed = _plan(lengths, world, min(budget, row_cap or budget), shared)
    return packed if len(packed[0]) <= len(padded[0]) else padded


def _plan(
    lengths: Sequence[int], world: int, budget: int, shared: int | None
) -> list[list[list[int]]]:
    plan: list[list[list[int]]] = []
    for share in split_over_ranks(lengths, world):
        bins = pack([lengths[i] for i in share], budget, shared=shared)
        plan.append([[share[j] for j in b] for b in bins])
    count = max(len(p) for p in plan)
    for p in plan:
        p.extend([] for _ in range(count - len(p)))
    return plan


def packs(items: Sequence[SequenceItem], row_cap: int | None) -> bool:
    """Whether `collate` packs these items: two or more, in one row of at most `row_cap` tokens
    (None: never). The packed row's attention runs over the whole row under its mask, so its
    cost grows with the square of the row's length, while what the shared prompt saves grows
    with the number of sequences: past a short row the padded rows are cheaper."""
    if row_cap is None or len(items) < 2:
        return False
    s = shared_prefix(items)
    return s + sum(item.length - s for item in items) <= row_cap


@dataclass(frozen=True, kw_only=True)
class PackedRow:
    """What the model runs for a micro-batch of several sequences: one row, their shared prefix
    once, then each sequence's own tokens (see the module docstring)."""

    input_ids: torch.Tensor  # [1, L] int64
    position_ids: torch.Tensor  # [1, L]: each sequence's own positions
    attention: torch.Tensor  # [1, 1, L, L] bool: True where a query may attend to a key
    index: torch.Tensor  # [N, W - 1]: where each sequence's target sits in the row's L - 1; -1 none
    bounds: tuple[int, ...]  # where the prefix ends, then where each sequence's part ends (L)

    def to(self, device: torch.device) -> PackedRow:
        return PackedRow(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            attention=self.attention.to(device),
            index=self.index.to(device),
            bounds=self.bounds,
        )


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """Padded per-sequence tensors of one micro-batch (targets are `input_ids[:, 1:]`), and the
    packed row the model runs instead of `input_ids` when there is one."""

    input_ids: torch.Tensor  # [N, W] int64
    behaviour: torch.Tensor  # [N, W - 1]
    proximal: torch.Tensor | None  # [N, W - 1], when every item carries one
    advantages: torch.Tensor  # [N]
    weights: torch.Tensor  # [N, W - 1]: w on loss tokens, 0 elsewhere
    packed: PackedRow | None = None

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, 1:]

    @property
    def row_targets(self) -> torch.Tensor:
        """The next-token targets of what the model runs: [rows, length - 1]."""
        rows = self.input_ids if self.packed is None else self.packed.input_ids
        return rows[:, 1:]

    def model_inputs(self, dtype: torch.dtype) -> dict[str, Any]:
        """Keyword arguments of the model's forward. A packed row's mask is additive, in `dtype`
        (what both the eager and the SDPA attention of Hugging Face models take), and its
        segment bounds go along for a model that attends by segments
        (`dora.learn.segment_attention`; other attention functions ignore them)."""
        if self.packed is None:
            return {"input_ids": self.input_ids}
        allowed = self.packed.attention
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return {
            "input_ids": self.packed.input_ids,
            "position_ids": self.packed.position_ids,
            "attention_mask": mask,
            SEGMENTS_KWARG: self.packed.bounds,
        }

    def unpack(self, per_row: torch.Tensor) -> torch.Tensor:
        """A per-target tensor of what the model ran ([rows, length - 1]) as per-sequence
        [N, W - 1]; 0 where a sequence has no target (padding)."""
        if self.packed is None:
            return per_row
        index = self.packed.index
        taken = per_row.reshape(-1)[index.clamp_min(0)]
        return torch.where(index >= 0, taken, torch.zeros_like(taken))

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
            packed=None if self.packed is None else self.packed.to(device),
        )


def forward_logprobs(
    model: torch.nn.Module, mb: MicroBatch, *, temperature: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's logprobs of its targets at the sampling `temperature` ([N, W - 1]), and the
    logits of what the model ran (the packed row, or the padded sequences)."""
    logits = model(**mb.model_inputs(dtype), use_cache=False).logits[:, :-1] / temperature
    return mb.unpack(token_logprobs(logits, mb.row_targets)), logits


def pack_row(items: Sequence[SequenceItem], width: int) -> PackedRow:
    """One row for `items`: their `shared_prefix` once, then each item's remaining tokens."""
    s = shared_prefix(items)
    parts = [items[0].tokens[:s]] + [item.tokens[s:] for item in items]
    row = np.concatenate(parts).astype(np.int64)
    owner = np.concatenate([np.full(len(p), k - 1) for k, p in enumerate(parts)])  # -1: prefix
    positions = np.concatenate([np.arange(s)] + [np.arange(s, item.length) for item in items])
    causal = np.tril(np.ones((len(row), len(row)), dtype=bool))
    attention = causal & ((owner[None, :] < 0) | (owner[None, :] == owner[:, None]))
    index = np.full((len(items), width - 1), -1, dtype=np.int64)
    bounds = tuple(int(b) for b in np.cumsum([s] + [item.length - s for item in items]))
    start = s
    for k, item in enumerate(items):
        t = np.arange(item.length - 1)
        q = np.where(t < s, t, start + t - s)
        # a target in the prefix is another item's token when the items part right after it
        ok = row[q + 1] == item.tokens[1:]
        index[k, : item.length - 1] = np.where(ok, q, -1)
        start += item.length - s
    return PackedRow(
        input_ids=torch.from_numpy(row)[None],
        position_ids=torch.from_numpy(positions.astype(np.int64))[None],
        attention=torch.from_numpy(attention)[None, None],
        index=torch.from_numpy(index),
        bounds=bounds,
    )


def collate(items: Sequence[SequenceItem], *, pad_id: int, packed: bool = False) -> MicroBatch:
    """Right-pad `items` into one micro-batch, and with `packed` (and two items or more) give it
    the packed row the model runs; no items gives a 1 x 2 zero-weight batch."""
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
        packed=pack_row(items, width) if packed and n > 1 else None,
    )
