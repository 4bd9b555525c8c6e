"""Trainer rank 0's side of the NCCL weight transfer: what it broadcasts is what serve tells the
instances to receive, tensor by tensor, in the same order, with nothing exchanged but the rule;
and without a GPU or vLLM it is refused, saying which.

The group here is gloo (one thread per rank, in this process) standing in for vLLM's NCCL
communicator; the trainer's code is the real `broadcast_weights`, and each receiver does what
vLLM's unpacked receive does with the `/update_weights` body serve builds: allocate each tensor
from its name, dtype and shape, in the body's order, and receive it."""

from __future__ import annotations

import datetime
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from dora.errors import ConfigError
from dora.learn.nccl import broadcast_weights, open_communicator
from dora.learn.publish import inline_chunks
from dora.weight_transfer import TransferGroup, UpdateInfo

pytestmark = pytest.mark.timeout(60)


class GlooCommunicator:
    """`broadcast(tensor, src)` over one rank of a gloo group."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.group = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=30))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()


def _published() -> dict[str, torch.Tensor]:
    """A version as the trainer publishes it: mixed dtypes, names not in sorted order."""
    gen = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen),
        "lm_head.weight": torch.randn(9, 4, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(4, generator=gen),
        "model.embed_tokens.weight": torch.randn(9, 4, generator=gen).to(torch.bfloat16),
    }


def _receive(communicator: GlooCommunicator, body: dict[str, object]) -> dict[str, torch.Tensor]:
    """What vLLM's unpacked NCCL receive does with an `/update_weights` body."""
    info = body["update_info"]
    assert isinstance(info, dict) and info["packed"] is False
    got = {}
    for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        communicator.broadcast(tensor, src=0)
        got[name] = tensor
    return got


def test_rank_0_broadcasts_what_serve_tells_the_instances_in_the_same_order() -> None:
    group = TransferGroup(master_address="127.0.0.1", master_port=29500, instances=2)
    published = _published()
    # serve's side knows the version as its weight store holds it: the published chunks
    (chunk,) = inline_chunks(published, version=3)
    body = UpdateInfo.of(chunk.names, chunk.dtypes, chunk.shapes).body()
    store = dist.HashStore()
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            communicator = GlooCommunicator(dist.PrefixStore("v3", store), r, group.world_size)
            if r == 0:
                results[r] = broadcast_weights(communicator, published, device="cpu")
            else:
                results[r] = _receive(communicator, body)
        except BaseException as exc:  # reported by the assertions below, never lost
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(group.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting on the broadcast"
    sent = results[0]
    assert isinstance(sent, UpdateInfo), sent
    assert sent.body() == body
    assert sent.names == sorted(published)
    for r in group.ranks(0).start, group.ranks(1).start:
        got = results[r]
        assert isinstance(got, dict), got
        assert list(got) == sorted(published)
        for name, tensor in published.items():
            assert got[name].dtype == tensor.dtype
            assert torch.equal(got[name], tensor), name


def test_the_groups_ranks_cover_every_worker_once() -> None:
    group = TransferGroup(
        master_address="10.0.0.9", master_port=29500, instances=3, tensor_parallel=2
    )
    ranks = [r for i in range(3) for r in group.ranks(i)]
    assert ranks == list(range(1, group.world_size)) and group.world_size == 7
    with pytest.raises(ValueError, match="master_port"):
        TransferGroup(master_address="10.0.0.9", master_port=0, instances=1)


def test_without_a_gpu_or_vllm_the_transfer_is_refused_saying_which(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = TransferGroup(master_address="127.0.0.1", master_port=29500, instances=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        open_communicator(group)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators.pynccl", None)
    with pytest.raises(ConfigError, match=r"dora\[vllm\]"):
        open_communicator(group)
