"""The sans-IO scheduling core: the transfer queue (staleness gate) and the orchestrator
(versions -> instances). No I/O, no clock, no asyncio; the server, the trainer and the simulator
drive these classes unchanged. docs/scheduling.md states the rules in plain words."""

from dora.core.orchestrator import (
    Action,
    Drain,
    Fail,
    FailReason,
    InstanceView,
    Load,
    Migrate,
    Mode,
    Orchestrator,
    Park,
    Resume,
    Undrain,
)
from dora.core.restart import Rollback, rollback
from dora.core.transfer_queue import (
    Accounting,
    Admitted,
    Assigned,
    FailureOutcome,
    GroupState,
    Refusal,
    RefusalReason,
    Refused,
    RollbackReport,
    TransferQueue,
    VersionCounts,
)

__all__ = [
    "Accounting",
    "Action",
    "Admitted",
    "Assigned",
    "Drain",
    "Fail",
    "FailReason",
    "FailureOutcome",
    "GroupState",
    "InstanceView",
    "Load",
    "Migrate",
    "Mode",
    "Orchestrator",
    "Park",
    "Refusal",
    "RefusalReason",
    "Refused",
    "Resume",
    "Rollback",
    "RollbackReport",
    "TransferQueue",
    "Undrain",
    "VersionCounts",
    "rollback",
]
