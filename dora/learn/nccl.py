"""Trainer rank 0's side of vLLM's NCCL weight transfer: open the group, broadcast a version.

`open_communicator` joins the group (`dora.weight_transfer.TransferGroup`) as rank 0, the rank
that listens: vLLM's `StatelessProcessGroup` rendezvous at `master_address:master_port`, then
its `PyNcclCommunicator` on this process's GPU. The group is vLLM's own, so its workers (which
run the other end in `/init_weight_transfer_engine`) and the trainer speak the same NCCL
bootstrap; the trainer therefore needs vLLM importable (`pip install 'dora[vllm]'`), and a GPU.
Either missing is refused with a `ConfigError` that says which, before any rank waits on the
rendezvous.

`broadcast_weights` sends the tensors of one published version, one broadcast per tensor, in the
order both sides derive (`broadcast_order`: sorted names), each as published (dtype and shape)
and moved to the communicator's GPU first. It returns the `UpdateInfo` serve sends to the
instances for the same version, so a test (or a caller) can check the two agree. The
communicator is anything with vLLM's `broadcast(tensor, src)`: vLLM's on GPUs, a gloo-backed
stand-in in the tests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

import torch

from dora.errors import ConfigError
from dora.weight_transfer import TransferGroup, UpdateInfo, broadcast_order

__all__ = ["Communicator", "broadcast_weights", "open_communicator"]


class Communicator(Protocol):
    """What a broadcast needs of the group (vLLM's `PyNcclCommunicator` has it)."""

    def broadcast(self, tensor: torch.Tensor, src: int) -> object: ...


def open_communicator(group: TransferGroup) -> Communicator:
    """Join `group` as rank 0 on this process's current GPU; blocks until every worker has
    joined (the instances' `/init_weight_transfer_engine`, sent concurrently by serve)."""
    if not torch.cuda.is_available():
        seen = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
        raise ConfigError(
            "NCCL weight transfer broadcasts from trainer rank 0's GPU, but this process sees "
            f"no CUDA device (CUDA_VISIBLE_DEVICES={seen!r}): give the trainer a GPU "
            "(learn.devices), or let the instances load each version from the weight store"
        )
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
    except ImportError as exc:
        raise ConfigError(
            "NCCL weight transfer joins vLLM's own NCCL group, so the trainer needs vLLM "
            f"importable ({exc}): pip install 'dora[vllm]' in the trainer's environment, or let "
            "the instances load each version from the weight store"
        ) from exc
    store = StatelessProcessGroup.create(
        host=group.master_address, port=group.master_port, rank=0, world_size=group.world_size
    )
    communicator: Communicator = PyNcclCommunicator(store, device=torch.cuda.current_device())
    return communicator


def broadcast_weights(
    communicator: Communicator,
    tensors: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str,
) -> UpdateInfo:
    """Broadcast every tensor of `tensors` (one published version) from rank 0, in broadcast
    order, each on `device`; return what the receivers must be told (`UpdateInfo`)."""
    info = UpdateInfo.of(
        list(tensors),
        [str(t.dtype) for t in tensors.values()],
        [list(t.shape) for t in tensors.values()],
    )
    with torch.no_grad():
        for name in broadcast_order(list(tensors)):
            tensor = tensors[name].detach().to(device).contiguous()
            communicator.broadcast(tensor, src=0)
    return info
