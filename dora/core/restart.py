"""The one entry point of a trainer restart for a driver of both halves of the core: the
transfer queue rolls back first, then the orchestrator forgets the live requests of every group
the queue removed, with no event in between.

Why one function: the order matters. Between `TransferQueue.rollback` and
`Orchestrator.rollback` the orchestrator still takes the ghost version for the newest, so any
event there that plans (a `finish` of a rolled-back group's request, in partial mode) resumes
parked requests of groups the queue kept on the ghost version, and the orchestrator's roll-back
then forgets them while the queue still counts them as running: the run stalls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from dora.core.orchestrator import Action, Orchestrator
from dora.core.outcomes import RollbackReport
from dora.core.transfer_queue import TransferQueue

__all__ = ["Rollback", "rollback"]


@dataclass(frozen=True, slots=True)
class Rollback:
    """What a roll-back decided: the queue's report, and the orchestrator's actions to carry
    out (in order). The requests of `report.rolled_back` are forgotten: abort them, and do
    not `finish` them."""

    report: RollbackReport
    actions: list[Action]


def rollback(
    queue: TransferQueue,
    orchestrator: Orchestrator,
    checkpoint_step: int,
    *,
    requests: Callable[[str], Iterable[str]],
    tainted: Collection[str] = (),
    newest: int | None = None,
) -> Rollback:
    """Roll back to the checkpoint of `checkpoint_step` (see `TransferQueue.rollback` for
    `tainted`). `requests(group)` names the group's requests (the ids given to `place`; ones
    that ended are skipped). `newest`: the newest version the orchestrator may load, when the
    driver does not hold `checkpoint_step + 1`'s weights yet (default: that version)."""
    report = queue.rollback(checkpoint_step, tainted=tainted)
    forget = [rid for gid in report.rolled_back for rid in requests(gid)]
    target = checkpoint_step + 1 if newest is None else newest
    return Rollback(report, orchestrator.rollback(target, forget=forget))
