"""Serve's side of a trainer restart (`Rollback`, wired to the trainer link's hello) in partial
mode: a group whose first version is real but that holds tokens of a ghost version is rolled back
with the ghosts, whether it still runs (its lease was resumed on the ghost) or has completed (a
sample's token versions)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dora.config import DoraConfig, LearnConfig, RolloutConfig
from dora.core.groups import GroupState
from dora.core.transfer_queue import Admitted
from dora.protocol import Group, Hello, Sample
from dora.serve.journal import JournaledQueue
from dora.serve.router import Router
from tests.unit.serve.link_parts import serve_parts


def sample(versions: list[int]) -> Sample:
    n = len(versions)
    return Sample.build(
        token_ids=[1] * n,
        loss_mask=[1] * n,
        logprobs=[0.0] * n,
        versions=versions,
        prompt_len=0,
        reward=0.0,
    )


async def test_partial_rollback_drops_groups_holding_ghost_tokens(tmp_path: Path) -> None:
    config = DoraConfig(
        rollout=RolloutConfig(mode="partial", batch_size=1, group_size=1, staleness=3),
        learn=LearnConfig(steps=10),
    )
    q = JournaledQueue(tmp_path, groups_per_step=1, max_staleness=3, num_steps=10)
    router = Router(kv_migration=True)
    parts = serve_parts(config, q, router, tmp_path)  # a roll-back sends nothing
    r, running, metrics = parts.link, parts.running, parts.metrics
    q.on_version_loaded(0)
    for gid in ("A", "B", "C", "D"):
        assert isinstance(q.try_admit(gid), Admitted)
        q.start(gid)
    tasks = {gid: asyncio.create_task(asyncio.sleep(3600)) for gid in ("A", "B")}
    for gid, task in tasks.items():
        running.started(gid, task)
    for gid in ("A", "B"):
        router.open(f"{gid}/0", version=0, instance="i0")
    router.resume("A/0", "i0", 1)  # real: the trainer restarts from step 0's checkpoint
    router.resume("B/0", "i0", 2)  # B samples from version 2 now, a ghost
    for gid, versions in (("C", [0, 1]), ("D", [0, 1, 2])):
        group = Group(id=gid, prompt_id=gid, version=0, samples=[sample(versions)])
        r.groups[gid] = group
        q.complete(gid)  # C fills step 0, D step 1
    q.on_step_done(0)
    try:
        parts.rollback(Hello(role="learn", incarnation=1, step=1))
        await asyncio.sleep(0)
        states = q.group_states()
        assert "B" not in states and "D" not in states  # ghost tokens: rolled back
        assert states["A"] is GroupState.STARTED  # C: trained at step 0, released
        assert "B/0" not in router.leases and "B" not in running and "A" in running
        assert tasks["B"].cancelled() and not tasks["A"].done()
        assert "D" not in r.groups and "C" in r.groups
    finally:
        for task in tasks.values():
            task.cancel()
        metrics.close()
        q.close()


class HelloLink:
    """A trainer link on which a restarted trainer says hello once, then nothing more."""

    def __init__(self, hello: Hello) -> None:
        self.hello: Hello | None = hello
        self.sent: list[object] = []

    async def recv(self, *, admit: object, answer: object) -> object:
        if self.hello is not None:
            hello, self.hello = self.hello, None
            return hello
        await asyncio.Event().wait()

    async def send(self, message: object, *, timeout_s: float | None = None) -> None:
        self.sent.append(message)


async def test_a_restarted_trainers_hello_rolls_back_through_the_wired_part(
    tmp_path: Path,
) -> None:
    """The trainer link hands an admitted restart's hello to the roll-back the composition root
    wired: the running group of a ghost version is stopped there, a real one keeps running, and
    serve answers the hello at the new incarnation."""
    config = DoraConfig(
        rollout=RolloutConfig(mode="dora", batch_size=1, group_size=1, staleness=3),
        learn=LearnConfig(steps=10),
    )
    q = JournaledQueue(tmp_path, groups_per_step=1, max_staleness=3, num_steps=10)
    link = HelloLink(Hello(role="learn", incarnation=1, step=0))
    parts = serve_parts(config, q, Router(kv_migration=True), tmp_path, link)
    q.on_version_loaded(0)
    for gid in ("A", "B"):
        assert isinstance(q.try_admit(gid), Admitted)
        q.start(gid)
    parts.link.groups["B"] = Group(id="B", prompt_id="B", version=0, samples=[sample([0])])
    q.complete("B")  # step 0, trained: version 1
    q.on_step_done(0)
    q.on_version_loaded(1)
    assert isinstance(q.try_admit("C", version=1), Admitted)  # a ghost once step 0 is lost
    q.start("C")
    tasks = {gid: asyncio.create_task(asyncio.sleep(3600)) for gid in ("A", "C")}
    for gid, task in tasks.items():
        parts.running.started(gid, task)
    receiver = asyncio.create_task(parts.link.receive())
    try:
        for _ in range(5):
            await asyncio.sleep(0)
        assert q.incarnation == 1 and "C" not in q.group_states()
        assert tasks["C"].cancelled() and not tasks["A"].done()
        assert "C" not in parts.running and "A" in parts.running
        assert link.sent == [Hello(role="serve", incarnation=1, step=q.step)]
    finally:
        receiver.cancel()
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(receiver, *tasks.values(), return_exceptions=True)
        parts.metrics.close()
        q.close()
