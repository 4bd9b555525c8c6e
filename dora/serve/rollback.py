"""Serve's roll-back when a trainer restarts from its checkpoint.

A restarted trainer says `Hello` with the next incarnation and the step it resumes at; the
trainer link admits it (`TrainerLink.refusal`) and hands it here (`TrainerLink.on_restart`).
The trainer resumes at `hello.step` from the checkpoint of step `c = hello.step - 1`
(docs/reliability.md). Versions newer than `c + 1` are ghosts: the restarted trainer will not
reproduce them. In one synchronous turn, as `dora.core.rollback` does it:

- the transfer queue rolls back to `c` (`TransferQueue.rollback`): groups of ghost versions, and
  in partial and inflight modes those holding a ghost token, are removed; the others are offered
  again;
- the removed groups that still run are stopped (`RunningGroups.stop`), and the trainer link
  forgets what it kept and queued for the lost run (`TrainerLink.rewind`);
- no instance holds a ghost any more (`InstanceVersions.forget_newer`), the weight store keeps
  the real versions only, and the orchestrator rolls back too: instances holding ghosts load the
  newest real version the store has, and the removed groups' leases are forgotten;
- what the queue's roll-back assigned goes out again.
"""

from __future__ import annotations

import logging

from dora.core.orchestrator import Orchestrator
from dora.errors import ProtocolError
from dora.protocol import Hello
from dora.records import Rollback as RollbackRecord
from dora.serve.journal import JournaledQueue
from dora.serve.metrics import MetricsLog
from dora.serve.placement import Placement
from dora.serve.running import RunningGroups, group_leases, lease_group
from dora.serve.trainer_link import TrainerLink
from dora.serve.versions import InstanceVersions
from dora.serve.weights import WeightStore

__all__ = ["Rollback"]

log = logging.getLogger("dora.serve")


class Rollback:
    """Rolls serve back to a restarted trainer's checkpoint (see the module docstring)."""

    def __init__(
        self,
        *,
        group_size: int,
        queue: JournaledQueue,
        trainer: TrainerLink,
        running: RunningGroups,
        placement: Placement,
        orchestrator: Orchestrator,
        versions: InstanceVersions,
        store: WeightStore,
        metrics: MetricsLog,
    ) -> None:
        self._group_size = group_size
        self._queue = queue
        self._trainer = trainer
        self._running = running
        self._placement = placement
        self._orchestrator = orchestrator
        self._versions = versions
        self._store = store
        self._metrics = metrics

    def __call__(self, hello: Hello) -> None:
        """Roll back to the checkpoint `hello` resumes from (see the module docstring)."""
        q, c = self._queue, hello.step - 1
        if self._trainer.refusal(hello) is not None or hello.incarnation != q.incarnation + 1:
            raise ProtocolError(f"not a restart serve admits: {hello}")
        log.warning(
            "trainer restarted (incarnation %d) from the checkpoint of step %d; rolling back",
            hello.incarnation,
            c,
        )
        # The checkpoint holds step c, so the trainer trained it: StepDones it sent just before
        # it died may have been lost with it.
        for step in range(q.trained_step + 1, c + 1):
            q.on_step_done(step)
        report = q.rollback(c, tainted=self._ghost_tainted(c + 1))
        rolled_back = list(report.rolled_back)
        self._running.stop(rolled_back)
        self._trainer.rewind(c, rolled_back)
        self._versions.forget_newer(c + 1)  # a ghost held must be loaded again
        self._store.set_incarnation(hello.incarnation)
        self._store.retain({v for v in self._store.versions() if v <= c + 1})
        self._metrics.write(
            RollbackRecord(incarnation=q.incarnation, step=c, rolled_back=len(rolled_back))
        )
        # A serve restored from its journal holds only version 0 until the trainer publishes its
        # starting version again: the orchestrator must not plan loads of weights not here yet.
        held = [v for v in self._store.versions() if v <= c + 1]
        leases = [lid for gid in rolled_back for lid in group_leases(gid, self._group_size)]
        newest = c + 1 if c + 1 in held else max(held, default=0)
        # Right after the queue's roll-back, as `dora.core.rollback` does: nothing in between.
        self._placement.apply(self._orchestrator.rollback(newest, forget=leases))
        self._trainer.assigned(report.assigned)

    def _ghost_tainted(self, newest: int) -> set[str]:
        """Groups holding a token of a version newer than `newest` (partial and inflight modes:
        a request resumed on, or moved under, a ghost version): their running leases follow the
        version that samples them now, and a completed group keeps each token's version."""
        tainted = {
            gid
            for lid in self._placement.leases_above(newest)
            if (gid := lease_group(lid)) in self._running
        }
        return tainted | self._trainer.groups_sampled_above(newest)
