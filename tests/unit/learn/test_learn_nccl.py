"""Trainer rank 0's side of the NCCL weight transfer: what it broadcasts is what serve tells the
instances to receive, tensor by tensor, in the same order, with nothing exchanged but the rule;
and without a GPU or vLLM it is refused, saying which.

The group here is gloo (one thread per rank, in this process) standing in for vLLM's NCCL
communicator; the trainer's code is the real `broadcast_weights`, and each receiver does what
vLLM's unpacked receive does with the `/update_weights` body serve builds: allocate each tensor
from its name, dtype and shape, in the body's order, and receive it."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.distributed as dist

from dora.errors import ConfigError
from dora.learn.nccl import NcclSender, broadcast_weights, open_communicator
from dora.learn.publish import inline_chunks
from dora.protocol import LearnMessage, NcclBroadcast, NcclDone, NcclListening, NcclOpen
from dora.weight_transfer import TransferGroup, UpdateInfo
from tests.unit.serve.nccl_parts import GlooCommunicator, receive

pytestmark = pytest.mark.timeout(60)


def _published() -> dict[str, torch.Tensor]:
    """A version as the trainer publishes it: mixed dtypes, names not in sorted order."""
    gen = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen),
        "lm_head.weight": torch.randn(9, 4, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(4, generator=gen),
        "model.embed_tokens.weight": torch.randn(9, 4, generator=gen).to(torch.bfloat16),
    }


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
                results[r] = receive(communicator, body)
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


class Recorder:
    """A communicator that records what it broadcasts, or blocks until released."""

    def __init__(self, *, block: bool = False) -> None:
        self.sent: list[torch.Tensor] = []
        self.release = threading.Event()
        if not block:
            self.release.set()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.release.wait(30)
        self.sent.append(tensor.clone())


def _sender(communicator: Recorder, timeout_s: float = 10) -> tuple[NcclSender, list[LearnMessage]]:
    sent: list[LearnMessage] = []
    sender = NcclSender(
        send=sent.append, address="127.0.0.1", port=29555, device="cpu", timeout_s=timeout_s,
        open=lambda group: communicator,
    )  # fmt: skip
    return sender, sent


def test_nccl_sender_opens_the_group_serve_asks_for_and_broadcasts_the_kept_version() -> None:
    communicator = Recorder()
    sender, sent = _sender(communicator)
    published = _published()
    sender.keep(2, published)
    published["model.norm.weight"].add_(1.0)  # the model trains on: the kept copy does not change
    sender.handle(NcclOpen(generation=1, instances=2, tensor_parallel=2))
    assert sent == [
        NcclListening(generation=1, address="127.0.0.1", port=29555),
        NcclDone(generation=1, version=-1),
    ]
    sender.handle(NcclBroadcast(generation=1, version=2))
    assert sent[-1] == NcclDone(generation=1, version=2)
    kept = _published()
    assert [t.shape for t in communicator.sent] == [kept[n].shape for n in sorted(kept)]
    pairs = zip(communicator.sent, sorted(kept), strict=True)
    assert all(torch.equal(tensor, kept[name]) for tensor, name in pairs)


def test_nccl_sender_refuses_another_version_or_a_group_it_did_not_open() -> None:
    sender, sent = _sender(Recorder())
    sender.keep(3, _published())
    sender.handle(NcclBroadcast(generation=1, version=3))
    assert sent[-1].error == "trainer rank 0 has no open NCCL group 1"  # type: ignore[union-attr]
    sender.handle(NcclOpen(generation=1, instances=1, tensor_parallel=1))
    sender.handle(NcclBroadcast(generation=1, version=2))
    assert "keeps version 3 for broadcast, not version 2" in sent[-1].error  # type: ignore[union-attr]


def test_nccl_broadcast_that_never_completes_is_cut_at_the_deadline_and_the_group_dropped() -> None:
    communicator = Recorder(block=True)
    sender, sent = _sender(communicator, timeout_s=0.5)
    sender.keep(1, _published())
    sender.handle(NcclOpen(generation=4, instances=1, tensor_parallel=1))
    try:
        sender.handle(NcclBroadcast(generation=4, version=1))
    finally:
        communicator.release.set()  # the stuck thread ends
    done = sent[-1]
    assert isinstance(done, NcclDone) and "within 0.5 s" in done.error
    sender.handle(NcclBroadcast(generation=4, version=1))  # the group is gone: serve opens anew
    assert "no open NCCL group 4" in sent[-1].error  # type: ignore[union-attr]
