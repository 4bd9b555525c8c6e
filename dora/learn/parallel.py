"""How the trainer's ranks share the model (`learn.strategy`): DDP or FSDP2.

Both strategies offer the trainer the same operations, so the step loop does not branch on them:
`prepare` (model and optimizer, the optimizer state of a checkpoint loaded), `accumulate` (the
context of a micro-batch whose gradients are not yet exchanged), `after_forward_only`,
`full_state_dict` (the whole model, for publishing and checkpoints), `clip_grad_norm`, and
`save_optimizer`.

- `ddp`: every rank holds the whole model (Accelerate's DDP over gloo on CPU). Micro-batches run
  under DDP's `no_sync`; one synchronising micro-batch per update all-reduces the accumulated
  gradients (`sync_micro_batch`). Every rank holds the same optimizer state; rank 0 saves it whole
  (`optimizer.pt`).
- `fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`): each module of the model's
  `_no_split_modules` classes (the decoder layers of a Hugging Face model) and then the root are
  sharded over all ranks, so each rank holds 1/world of every parameter, of its gradient and of its
  optimizer state. Every backward reduce-scatters its gradients (keeping them sharded is the point
  of FSDP), so no synchronising micro-batch is needed. The gradient of a sum of micro-batches is
  the sum of their reduce-scattered gradients, and FSDP, like DDP, averages over ranks, so the
  trainer's `world / Z` scaling holds unchanged. Every forward all-gathers parameters: every rank
  must run the same forwards in the same order, which the equal micro-batch plan guarantees.
  Weights are gathered whole onto rank 0 for publishing and for the checkpoint's Hugging Face
  folder; the optimizer state is saved sharded with `torch.distributed.checkpoint` (DCP): every
  rank writes its own share into `optimizer/` of the checkpoint (so the run directory must be on a
  filesystem every trainer node sees). DCP reshards on load, so resuming on another number of
  ranks should work; the tests resume on the same two ranks only.

Accelerate's own FSDP and DeepSpeed integrations are not used: Accelerate ignores its FSDP plugin
on CPU (the model silently becomes DDP), and DeepSpeed owns gradient accumulation, which breaks the
trainer's exact `1 / Z` normalisation applied after the step's last backward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

Strategy = Literal["ddp", "fsdp"]
OPTIMIZER_FILE = "optimizer.pt"  # ddp: the whole optimizer state dict
OPTIMIZER_SHARDS = "optimizer"  # fsdp: a DCP folder with every rank's share

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class DataParallel:
    """`learn.strategy = "ddp"`: Accelerate's DDP (or nothing, with one process)."""

    name: Strategy = "ddp"

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.world = int(accelerator.num_processes)
        self.sync_micro_batch = self.world > 1

    def prepare(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory,
        checkpoint: Path | None,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module]:
        """(model to train, optimizer, the unwrapped model) with `checkpoint`'s optimizer state."""
        optimizer = make_optimizer(list(model.parameters()))
        if checkpoint is not None:
            optimizer.load_state_dict(self.load_optimizer_file(checkpoint))
        wrapped, optimizer = self.accelerator.prepare(model, optimizer)
        return wrapped, optimizer, self.accelerator.unwrap_model(wrapped)

    def accumulate(self, model: torch.nn.Module) -> AbstractContextManager[object]:
        if self.world > 1:
            return self.accelerator.no_sync(model)
        return nullcontext()

    def after_forward_only(self, model: torch.nn.Module) -> None:
        """Nothing to release after a forward without backward."""

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return self.accelerator.get_state_dict(model)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        return float(self.accelerator.clip_grad_norm_(model.parameters(), max_norm))

    def save_optimizer(
        self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path
    ) -> None:
        """Rank 0 writes `path/optimizer.pt` (every rank holds the same state)."""
        if self.accelerator.process_index == 0:
            torch.save(optimizer.state_dict(), path / OPTIMIZER_FILE)

    @staticmethod
    def load_optimizer_file(checkpoint: Path) -> dict[str, object]:
        file = checkpoint / OPTIMIZER_FILE
        if not file.exists():
            raise _wrong_strategy(checkpoint, "ddp")
        state: dict[str, object] = torch.load(file, weights_only=True)
        return state


class FullySharded:
    """`learn.strategy = "fsdp"`: FSDP2 over every rank (see the module docstring)."""

    name: Strategy = "fsdp"
    sync_micro_batch = False

    def __init__(self, accelerator: Accelerator) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from dora.errors import ConfigError

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                'learn.strategy = "fsdp" shards the model over several ranks: set learn.processes '
                "to 2 or more, or start the ranks with torchrun or accelerate launch"
            )
        self.accelerator = accelerator
        self.world = int(accelerator.num_processes)
        self.device = accelerator.device
        self.mesh = init_device_mesh(self.device.type, (self.world,))

    def prepare(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory,
        checkpoint: Path | None,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module]:
        from torch.distributed.fsdp import fully_shard

        model.to(self.device)
        layer_classes = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if module is not model and type(module).__name__ in layer_classes:
                fully_shard(module, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        optimizer = make_optimizer(list(model.parameters()))
        if checkpoint is not None:
            self.load_optimizer(optimizer, model, checkpoint)
        return model, optimizer, model

    def accumulate(self, model: torch.nn.Module) -> AbstractContextManager[object]:
        return nullcontext()  # every backward reduce-scatters: gradients stay sharded

    def after_forward_only(self, model: torch.nn.Module) -> None:
        """Reshard what a forward without backward left gathered: FSDP keeps the root's
        parameters unsharded after its forward (for the backward it expects), and a later forward
        would reuse them after the optimizer has updated their shards."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model on rank 0 (on CPU), an empty dict elsewhere; every rank must call it."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def save_optimizer(
        self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path
    ) -> None:
        """Every rank writes its share to `path/optimizer/` (a collective)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._optimizer_state(optimizer, model), checkpoint_id=path / OPTIMIZER_SHARDS)

    def load_optimizer(
        self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, checkpoint: Path
    ) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        folder = checkpoint / OPTIMIZER_SHARDS
        if not folder.is_dir():
            raise _wrong_strategy(checkpoint, "fsdp")
        state = self._optimizer_state(optimizer, model)  # the layout to load into (this world)
        dcp.load(state, checkpoint_id=folder)
        set_optimizer_state_dict(model, optimizer, state["optimizer"])

    @staticmethod
    def _optimizer_state(
        optimizer: torch.optim.Optimizer, model: torch.nn.Module
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {"optimizer": get_optimizer_state_dict(model, optimizer)}


def refuse_accelerate_plugins() -> None:
    """`accelerate launch --use_fsdp / --use_deepspeed` would train under an integration dora does
    not drive (on CPU, `--use_fsdp` silently gives DDP): name the setting that does it instead."""
    import os

    from dora.errors import ConfigError

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ConfigError(
            "accelerate launch --use_deepspeed is not supported by dora learn: DeepSpeed owns "
            "gradient accumulation, which breaks the exact per-step loss normalisation; launch "
            'without it and set learn.strategy = "fsdp" to shard parameters, gradients and '
            "optimizer state"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        raise ConfigError(
            "accelerate launch --use_fsdp is not how dora learn shards: launch without it and set "
            'learn.strategy = "fsdp" (dora applies FSDP2 itself, with sharded checkpoints)'
        )


def make_parallel(strategy: Strategy, accelerator: Accelerator) -> DataParallel | FullySharded:
    return FullySharded(accelerator) if strategy == "fsdp" else DataParallel(accelerator)


def _wrong_strategy(checkpoint: Path, strategy: Strategy) -> Exception:
    from dora.errors import ConfigError

    other = "fsdp" if strategy == "ddp" else "ddp"
    missing = OPTIMIZER_FILE if strategy == "ddp" else OPTIMIZER_SHARDS
    return ConfigError(
        f"learn.strategy = {strategy!r}, but the checkpoint {checkpoint} was written by "
        f"learn.strategy = {other!r} (it has no {missing}): resume with learn.strategy = {other!r}"
    )
