"""The trainer's own loop with `learn.weight_transport = "nccl"`: rank 0 publishes a version
inline, keeps it while it waits for the next step's groups, and answers serve's `NcclOpen` and
`NcclBroadcast` there, broadcasting exactly what it published. A stand-in for serve on the real
link joins the group (gloo standing in for NCCL, the trainer's GPU and vLLM checks replaced by
it) and receives what serve's `/update_weights` body names."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from learn_standin import StandIn
from test_learn_loop import on_policy_groups, write_config

import dora.learn.trainer as trainer_module
from dora.config import DoraConfig, load_config
from dora.learn.nccl import NcclSender
from dora.learn.publish import state_dict_from_chunks
from dora.models import TinyModelSpec, build_tiny_model
from dora.protocol import (
    Assigned,
    LearnMessage,
    NcclBroadcast,
    NcclDone,
    NcclListening,
    NcclOpen,
    Shutdown,
    StepClosed,
    WeightChunk,
)
from dora.weight_transfer import UpdateInfo
from tests.unit.serve.nccl_parts import GlooCommunicator, gloo_trainer, receive

pytestmark = pytest.mark.timeout(240)


def _gloo_sender(config: DoraConfig, send: Callable[[LearnMessage], None]) -> NcclSender:
    """What `nccl_sender` builds on a GPU, with the gloo group in place of vLLM's."""
    return NcclSender(
        send=send,
        address="127.0.0.1",
        device="cpu",
        timeout_s=30,
        open=gloo_trainer,
    )


async def _next(standin: StandIn, kind: type) -> LearnMessage:
    while not isinstance(message := await standin.recv(), kind):
        pass
    return message


async def test_nccl_trainer_broadcasts_the_version_it_published_when_serve_asks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = build_tiny_model(tmp_path / "tiny", TinyModelSpec(seed=1))
    standin = StandIn(tiny)
    monkeypatch.setattr(trainer_module, "nccl_sender", _gloo_sender)
    config = write_config(tmp_path, tiny, steps=3, weight_transport="nccl")
    overrides = ["serve.backend=vllm", "learn.micro_batch_tokens=64"]
    try:
        learner = _train_in_thread(load_config(config, overrides), tmp_path / "run", standin)
        make = on_policy_groups(standin)
        hello = await standin.recv()
        assert hello.role == "learn"  # type: ignore[union-attr]
        groups = make(0, 0)
        for group in groups:
            await standin.link.send(Assigned(step=0, group=group))
        await standin.link.send(StepClosed(step=0, num_groups=len(groups)))
        await standin._until_step_done(0)
        chunks = [m for m in standin.record.of(WeightChunk) if m.version == 1]
        published = state_dict_from_chunks(chunks)
        body = UpdateInfo.of(
            [n for c in chunks for n in c.names],
            [d for c in chunks for d in c.dtypes],
            [s for c in chunks for s in c.shapes],
        ).body()

        await standin.link.send(NcclOpen(generation=1, instances=1, tensor_parallel=1))
        where = await _next(standin, NcclListening)
        assert isinstance(where, NcclListening) and where.generation == 1
        joined: dict[str, object] = {}

        def worker() -> None:  # what a vLLM worker does: join, then receive one version
            store = torch.distributed.TCPStore(where.address, where.port, 2, is_master=False)
            communicator = GlooCommunicator(store, 1, 2)
            joined["open"] = True
            ready.wait(60)
            joined["weights"] = receive(communicator, body)

        ready = threading.Event()
        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        assert await _next(standin, NcclDone) == NcclDone(generation=1, version=-1)
        ready.set()
        await standin.link.send(NcclBroadcast(generation=1, version=1))
        assert await _next(standin, NcclDone) == NcclDone(generation=1, version=1)
        await asyncio.to_thread(thread.join, 60)
        got = joined["weights"]
        assert isinstance(got, dict) and list(got) == sorted(published)
        for name, tensor in published.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)

        await standin.link.send(Shutdown(reason="test stops serve"))
        assert await asyncio.wait_for(learner, 60) == 0
    finally:
        standin.close()


def _train_in_thread(config: DoraConfig, run_dir: Path, standin: StandIn) -> asyncio.Future[int]:
    """The trainer itself (`dora learn` would refuse NCCL on a machine without a GPU before it
    builds one), in a thread; the future resolves to `run()`'s status."""
    from dora.learn.trainer import Trainer

    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    def target() -> None:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            trainer = Trainer(config, run_dir=run_dir, address=standin.link.address, resume=False)
            rc = trainer.run()
        except BaseException as exc:  # handed to the test, which re-raises it
            loop.call_soon_threadsafe(future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(future.set_result, rc)

    threading.Thread(target=target, daemon=True).start()
    return future
