"""Serve's side of a trainer restart (`TrainerLink.rollback`) in partial mode: a group whose first
version is real but that holds tokens of a ghost version is rolled back with the ghosts, whether
it still runs (its lease was resumed on the ghost) or has completed (a sample's token versions)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dora.config import DoraConfig, LearnConfig, RolloutConfig
from dora.core.groups import GroupState
from dora.core.transfer_queue import Admitted
from dora.protocol import Group, Hello, Sample
from dora.serve.journal import JournaledQueue
from dora.serve.router import Router
from tests.unit.serve.link_parts import trainer_link


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
    r, metrics = trainer_link(config, q, router, tmp_path)  # a roll-back sends nothing
    q.on_version_loaded(0)
    for gid in ("A", "B", "C", "D"):
        assert isinstance(q.try_admit(gid), Admitted)
        q.start(gid)
    r.group_tasks = {gid: asyncio.create_task(asyncio.sleep(3600)) for gid in ("A", "B")}
    for gid in ("A", "B"):
        router.open(f"{gid}/0", version=0, instance="i0")
    router.resume("A/0", "i0", 1)  # real: the trainer restarts from step 0's checkpoint
    router.resume("B/0", "i0", 2)  # B samples from version 2 now, a ghost
    for gid, versions in (("C", [0, 1]), ("D", [0, 1, 2])):
        group = Group(id=gid, prompt_id=gid, version=0, samples=[sample(versions)])
        r.groups[gid] = group
        q.complete(gid)  # C fills step 0, D step 1
    q.on_step_done(0)
    tasks = dict(r.group_tasks)
    try:
        r.rollback(Hello(role="learn", incarnation=1, step=1))
        await asyncio.sleep(0)
        states = q.group_states()
        assert "B" not in states and "D" not in states  # ghost tokens: rolled back
        assert states["A"] is GroupState.STARTED  # C: trained at step 0, released
        assert "B/0" not in router.leases and "B" not in r.group_tasks
        assert tasks["B"].cancelled() and not tasks["A"].done()
        assert "D" not in r.groups and "C" in r.groups
    finally:
        for task in tasks.values():
            task.cancel()
        metrics.close()
        q.close()
