"""LoRA adapter versions held by one engine, applied per row: several versions in one forward.

A LoRA version is a set of low-rank pairs, one per targeted linear layer: `A` (`[r, in]`) and `B`
(`[out, r]`, the scaling already folded in; dora.learn.lora publishes them so), named as in peft's
adapter files: `base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`. The layer's output
for a row of version `v` is `W x + B_v (A_v x)`.

`AdapterSet` keeps every held version's pairs stacked, per module, in `[slots, r, in]` and
`[slots, out, r]` tensors. Slot 0 is all zeros: the base version (the model's own weights). Each
row of a batch carries its slot; the delta of a layer for the whole batch is two batched matmuls
over the rows' gathered matrices (`A[slots]`, `B[slots]`), so rows of different versions share
the base matmul and one forward, and a row's result does not depend on its neighbours'
versions.

Two ways in:
- Hugging Face modules (prefill, and decode of models without the fused step): a forward hook on
  every targeted linear adds the delta for the rows given by `row_slots` (set around each forward
  by the batcher; None means no adapters for this forward);
- the fused decode step (fused.py) asks `group_stacks` for the pairs of a group of layers whose
  weights it concatenates (q, k, v; gate, up), as one `[slots, R, in]` and a block-diagonal
  `[slots, out, R]`, so each group is one delta as it is one base matmul.

Invariants: every held version targets the same modules with the same rank (the first adapter
loaded fixes them; a different one is refused, nothing changes); a load validates every name and
shape before it changes anything; `generation` grows with every change, so cached group stacks
are rebuilt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


def is_adapter(names: list[str] | Mapping[str, object]) -> bool:
    """Whether a set of weight names is a LoRA adapter (rather than the model's own weights)."""
    return bool(names) and all(n.endswith((_A, _B)) for n in names)


class AdapterSet:
    """The adapter versions of one engine, by slot; see the module docstring."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._linears = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
        }
        self.slot_of: dict[int, int] = {}
        """Version -> slot (slot 0, the base, is in no entry)."""
        self.rank = 0
        self.targets: list[str] = []
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.generation = 0
        self.row_slots: torch.Tensor | None = None
        self._hooks: list[Any] = []
        self._groups: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._groups_generation = -1

    @property
    def versions(self) -> list[int]:
        return sorted(self.slot_of)

    def _parse(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if not name.startswith(PREFIX) or not name.endswith((_A, _B)):
                raise ValueError(f"{name}: not a LoRA adapter weight (<prefix>{PREFIX}...{_A})")
            path, which = name[len(PREFIX) : -len(_A)], name[-len(_A) :]
            pairs.setdefault(path, {})[which] = tensor
        out: dict[str, tuple[torch.Tensor, ...]] = {}
        for path, pair in sorted(pairs.items()):
            linear = self._linears.get(path)
            if linear is None:
                raise ValueError(f"{path}: the model has no linear layer of that name")
            if set(pair) != {_A, _B}:
                raise ValueError(f"{path}: an adapter needs both lora_A and lora_B")
            a, b = pair[_A], pair[_B]
            r = a.shape[0]
            if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, linear.in_features):
                raise ValueError(
                    f"{path}: lora_A of shape {tuple(a.shape)}, needs [r, {linear.in_features}]"
                )
            if tuple(b.shape) != (linear.out_features, r):
                raise ValueError(
                    f"{path}: lora_B of shape {tuple(b.shape)}, needs [{linear.out_features}, {r}]"
                )
            out[path] = (a, b)
        ranks = {a.shape[0] for a, _ in out.values()}
        if len(ranks) != 1:
            raise ValueError(f"adapter layers of different ranks {sorted(ranks)}")
        if self.targets and (sorted(out) != self.targets or ranks != {self.rank}):
            raise ValueError(
                f"adapter of rank {ranks.pop()} on {len(out)} layers; the versions held have rank "
                f"{self.rank} on {len(self.targets)} layers (every version must have the same)"
            )
        return out

    def add(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hold `tensors` as `version` (replacing the same version if held); nothing changes if
        they are invalid (ValueError)."""
        pairs = self._parse(tensors)
        if not self.targets:
            self._allocate(pairs)
        slot = self.slot_of.get(version)
        if slot is None:
            used = set(self.slot_of.values())
            slot = next(s for s in range(1, len(used) + 2) if s not in used)
            if slot >= next(iter(self.a.values())).shape[0]:
                self._grow()
        with torch.no_grad():
            for path, (a, b) in pairs.items():
                self.a[path][slot].copy_(a)
                self.b[path][slot].copy_(b)
        self.slot_of[version] = slot
        self.generation += 1

    def holds(self, version: int, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether `version` is held with exactly `tensors` (as `add` would store them)."""
        slot = self.slot_of.get(version)
        if slot is None:
            return False
        pairs = self._parse(tensors)
        return sorted(pairs) == self.targets and all(
            torch.equal(self.a[path][slot], a.to(self.a[path].device, self.a[path].dtype))
            and torch.equal(self.b[path][slot], b.to(self.b[path].device, self.b[path].dtype))
            for path, (a, b) in pairs.items()
        )

    def remove(self, version: int) -> None:
        slot = self.slot_of.pop(version)
        for path in self.targets:
            self.a[path][slot].zero_()
            self.b[path][slot].zero_()
        self.generation += 1

    def clear(self) -> None:
        for slot in list(self.slot_of.values()):
            for path in self.targets:
                self.a[path][slot].zero_()
                self.b[path][slot].zero_()
        self.slot_of.clear()
        self.generation += 1

    def _allocate(self, pairs: Mapping[str, tuple[torch.Tensor, ...]]) -> None:
        self.targets = sorted(pairs)
        self.rank = int(next(iter(pairs.values()))[0].shape[0])
        for path in self.targets:
            w = self._linears[path].weight
            # the adapters sit beside the weights, on their device
            self.a[path] = w.new_zeros(4, self.rank, w.shape[1])
            self.b[path] = w.new_zeros(4, w.shape[0], self.rank)
            self._hooks.append(self._linears[path].register_forward_hook(self._hook(path)))

    def _grow(self) -> None:
        for stacks in (self.a, self.b):
            for path, t in stacks.items():
                stacks[path] = torch.cat([t, torch.zeros_like(t)])

    # -- applying ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def rows(self, slots: torch.Tensor) -> Iterator[None]:
        """Within: HF-module forwards add row i's delta under the adapter of `slots[i]`."""
        self.row_slots = slots if bool(slots.any()) else None
        try:
            yield
        finally:
            self.row_slots = None

    def _hook(self, path: str) -> Any:
        def hook(
            _module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
        ) -> torch.Tensor | None:
            if self.row_slots is None:
                return None
            return output + delta(inputs[0], self.a[path], self.b[path], self.row_slots)

        return hook

    def group_stacks(self, paths: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pairs of `paths` (layers whose outputs are concatenated, in this order) as one
        `[slots, R, in]` and one block-diagonal `[slots, sum(out), R]`; None if none is targeted."""
        if self._groups_generation != self.generation:
            self._groups.clear()
            self._groups_generation = self.generation
        if paths not in self._groups:
            self._groups[paths] = self._build_group(paths)
        return self._groups[paths]

    def _build_group(self, paths: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        targeted = [p for p in paths if p in self.a]
        if not targeted:
            return None
        slots = next(iter(self.a.values())).shape[0]
        outs = [self._linears[p].out_features for p in paths]
        r = self.rank
        a = torch.cat([self.a[p] for p in targeted], dim=1)
        b = torch.zeros(slots, sum(outs), r * len(targeted), dtype=a.dtype, device=a.device)
        row, col = 0, 0
        for p, out in zip(paths, outs, strict=True):
            if p in self.b:
                b[:, row : row + out, col : col + r] = self.b[p]
                col += r
            row += out
        return a, b


def delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`B_s (A_s x)` for every row of `x` (`[rows, ..., in]`), row i with the pair of `slots[i]`."""
    rows = x.shape[0]
    flat = x.reshape(rows, -1, x.shape[-1])
    low = torch.bmm(flat, a[slots].transpose(1, 2))
    out = torch.bmm(low, b[slots].transpose(1, 2))
    return out.reshape(*x.shape[:-1], b.shape[1])
