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

`NcclSender` is what a run uses (`learn.weight_transport = "nccl"`): rank 0 keeps a host copy of
the version it published last (`keep`) and answers serve's messages, which arrive between the
groups of the next step: `NcclOpen` opens the group serve asks for (it says where it listens,
`NcclListening`, then blocks until every worker joined), `NcclBroadcast` broadcasts the kept
version once serve has paused the instances and posted their update; each is answered with
`NcclDone`, carrying the error when it failed (serve then loads the instances from its weight
store). Both run in a thread joined with a deadline (`timeout_s`), so a worker that never joins or
never receives costs the trainer that long, not its run: the group is then dropped, and serve
opens a new one for the next version. A request for another version than the one kept (serve was
slower than the trainer) is refused the same way.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from dora.errors import ConfigError, DoraError
from dora.net import free_port
from dora.protocol import LearnMessage, NcclBroadcast, NcclDone, NcclListening, NcclOpen
from dora.weight_transfer import TransferGroup, UpdateInfo, broadcast_order

if TYPE_CHECKING:
    from dora.config import DoraConfig

__all__ = [
    "Communicator",
    "NcclSender",
    "broadcast_weights",
    "nccl_sender",
    "open_communicator",
    "require_nccl",
]

T = TypeVar("T")


class Communicator(Protocol):
    """What a broadcast needs of the group (vLLM's `PyNcclCommunicator` has it)."""

    def broadcast(self, tensor: torch.Tensor, src: int) -> object: ...


def require_nccl() -> None:
    """`ConfigError` unless this process can join vLLM's NCCL group: a GPU, and vLLM importable."""
    if not torch.cuda.is_available():
        seen = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
        raise ConfigError(
            "NCCL weight transfer broadcasts from trainer rank 0's GPU, but this process sees "
            f"no CUDA device (CUDA_VISIBLE_DEVICES={seen!r}): give the trainer a GPU "
            "(learn.devices), or let the instances load each version from the weight store"
        )
    try:
        for module in ("vllm.distributed.device_communicators.pynccl", "vllm.distributed.utils"):
            importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            "NCCL weight transfer joins vLLM's own NCCL group, so the trainer needs vLLM "
            f"importable ({exc}): pip install 'dora[vllm]' in the trainer's environment, or let "
            "the instances load each version from the weight store"
        ) from exc


def open_communicator(group: TransferGroup) -> Communicator:
    """Join `group` as rank 0 on this process's current GPU; blocks until every worker has
    joined (the instances' `/init_weight_transfer_engine`, sent concurrently by serve)."""
    require_nccl()
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

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


class NcclSender:
    """Trainer rank 0's side of each version's broadcast (see the module docstring)."""

    def __init__(
        self,
        *,
        send: Callable[[LearnMessage], None],
        address: str,
        port: int = 0,
        device: torch.device | str,
        timeout_s: float,
        open: Callable[[TransferGroup], Communicator] = open_communicator,
    ) -> None:
        self._send = send
        self._address = address
        self._port = port
        self._device = torch.device(device)
        self._timeout_s = timeout_s
        self._open = open
        self._generation = 0
        self._communicator: Communicator | None = None
        self._kept: tuple[int, dict[str, torch.Tensor]] | None = None

    def keep(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """`version` is published: keep a host copy of its tensors for its broadcast (the model
        trains on meanwhile)."""
        copy = {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
        self._kept = (version, copy)

    def handle(self, message: NcclOpen | NcclBroadcast) -> None:
        """Answer one of serve's NCCL messages (`NcclDone`, with the error if it failed)."""
        if isinstance(message, NcclOpen):
            version, error = -1, self._open_group(message)
        else:
            version, error = message.version, self._broadcast(message)
        self._send(NcclDone(generation=message.generation, version=version, error=error))

    def _open_group(self, message: NcclOpen) -> str:
        self._communicator = None  # whatever happens, the previous group is done with
        port = self._port or free_port(self._address)
        group = TransferGroup(
            master_address=self._address,
            master_port=port,
            instances=message.instances,
            tensor_parallel=message.tensor_parallel,
        )
        self._send(NcclListening(generation=message.generation, address=self._address, port=port))
        try:
            communicator = self._bounded(lambda: self._open(group), "opening the NCCL group")
        except (DoraError, RuntimeError, OSError, TimeoutError) as exc:
            return f"trainer rank 0 could not open NCCL group {message.generation}: {exc}"
        self._communicator, self._generation = communicator, message.generation
        return ""

    def _broadcast(self, message: NcclBroadcast) -> str:
        communicator = self._communicator
        if communicator is None or message.generation != self._generation:
            return f"trainer rank 0 has no open NCCL group {message.generation}"
        if self._kept is None or self._kept[0] != message.version:
            held = "none" if self._kept is None else f"version {self._kept[0]}"
            return f"trainer rank 0 keeps {held} for broadcast, not version {message.version}"
        tensors = self._kept[1]
        try:
            self._bounded(
                lambda: broadcast_weights(communicator, tensors, device=self._device),
                f"the broadcast of version {message.version}",
            )
        except (DoraError, RuntimeError, OSError, TimeoutError) as exc:
            self._communicator = None  # its ranks may be out of step: serve opens a new one
            return f"trainer rank 0 did not broadcast version {message.version}: {exc}"
        return ""

    def _bounded(self, fn: Callable[[], T], what: str) -> T:
        """`fn()` in a thread on this rank's device, waited for at most `timeout_s`."""
        out: list[T] = []
        failed: list[BaseException] = []

        def run() -> None:
            try:
                with _on(self._device):
                    out.append(fn())
            except BaseException as exc:  # handed to the caller below
                failed.append(exc)

        thread = threading.Thread(target=run, name="dora-nccl", daemon=True)
        thread.start()
        thread.join(self._timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"{what} did not finish within {self._timeout_s:g} s")
        if failed:
            raise failed[0]
        return out[0]


def _on(device: torch.device) -> AbstractContextManager[object]:
    """The thread's current CUDA device (where vLLM's communicator runs its stream)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def nccl_sender(config: DoraConfig, send: Callable[[LearnMessage], None]) -> NcclSender:
    """Rank 0's sender for `learn.weight_transport = "nccl"`; refused (`ConfigError`) before
    anything waits when this process has no GPU or no vLLM."""
    require_nccl()
    return NcclSender(
        send=send,
        address=config.learn.nccl_address,
        port=config.learn.nccl_port,
        device=torch.device("cuda", torch.cuda.current_device()),
        timeout_s=config.serve.weight_load_timeout_s,
    )
