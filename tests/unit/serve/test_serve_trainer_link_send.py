"""Serve's sender to the trainer gives the event loop a turn between groups: a step's groups are
assigned at once, and each send may finish without waiting (the journal written, the socket
ready), so without a turn a step's hundreds of groups went out in one loop iteration (1.3 s at
paper-64 with 128 instances), and every timer, probe and answer waited for it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dora.config import DoraConfig, LearnConfig, RolloutConfig
from dora.core.transfer_queue import Admitted
from dora.protocol import Group, Sample
from dora.serve.journal import JournaledQueue
from dora.serve.router import Router
from tests.unit.serve.link_parts import trainer_link

GROUPS = 8


class Link:
    """Sends at once, as a ready ZMQ socket does, and records what it sent."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, message: object, *, timeout_s: float) -> None:
        self.sent.append(message)


async def test_the_sender_yields_to_the_loop_between_groups(tmp_path: Path) -> None:
    config = DoraConfig(
        rollout=RolloutConfig(mode="dora", batch_size=GROUPS, group_size=1, staleness=1),
        learn=LearnConfig(steps=2),
    )
    q = JournaledQueue(tmp_path, groups_per_step=GROUPS, max_staleness=1, num_steps=2)
    link = Link()
    r, metrics = trainer_link(config, q, Router(kv_migration=True), tmp_path, link)
    q.on_version_loaded(0)
    assigned = []
    for k in range(GROUPS):
        gid = f"g{k}"
        assert isinstance(q.try_admit(gid), Admitted)
        q.start(gid)
        sample = Sample.build(
            token_ids=[1, 2],
            loss_mask=[0, 1],
            logprobs=[0.0, 0.0],
            versions=[-1, 0],
            prompt_len=1,
            reward=1.0,
        )
        r.groups[gid] = Group(id=gid, prompt_id=gid, version=0, samples=[sample])
        assigned += q.complete(gid)
    assert len(assigned) == GROUPS  # the whole step at once
    await q.written()
    r.assigned(assigned)
    seen: list[int] = []
    sender = asyncio.create_task(r.send())
    try:
        for _ in range(4 * GROUPS):  # one loop turn each
            await asyncio.sleep(0)
            seen.append(len(link.sent))
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        metrics.close()
        q.close()
    assert link.sent, "the sender ran"
    assert len(set(seen)) > 2, f"sent {seen[0]} groups in the first turn, then {seen[1:]}"
    assert len(link.sent) == GROUPS + 1  # every group, then the step's StepClosed
