"""The sans-IO scheduling core: the transfer queue (staleness gate) and the orchestrator
(versions -> instances). No I/O, no clock, no asyncio; the server, the trainer and the simulator
drive these classes unchanged. docs/scheduling.md states the rules in plain words."""

from dora.core.orchestrator import (
    Action,
    Drain,
    InstanceView,
    Load,
    Migrate,
    Mode,
    Orchestrator,
    Park,
    Resume,
    Undrain,
)
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
    TrainerWait,
    TransferQueue,
    VersionCounts,
)

__all__ = [
    "Accounting",
    "Action",
    "Admitted",
    "Assigned",
    "Drain",
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
    "RollbackReport",
    "TrainerWait",
    "TransferQueue",
    "Undrain",
    "VersionCounts",
]
