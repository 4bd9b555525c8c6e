"""The values the transfer queue takes and returns: refusal and wait reasons, group states,
admissions, assignments, failure outcomes, roll-back reports, counts. Plain frozen dataclasses and
enums, so a driver can pattern-match on them and a journal or a metrics sink can store them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Accounting",
    "Admitted",
    "Assigned",
    "FailureOutcome",
    "GroupState",
    "Refusal",
    "RefusalReason",
    "Refused",
    "RollbackReport",
    "VersionCounts",
]


class RefusalReason(enum.Enum):
    """Why a group cannot be admitted now."""

    WEIGHTS_NOT_LOADED = "weights_not_loaded"
    """Rule (a): no loaded version `w` has `w + K >= t` (or none is loaded at all)."""
    INVARIANT = "invariant"
    """Rule (b): one more group of that deadline would break `U(<= s) <= cap(s)`."""
    HORIZON = "horizon"
    """The run's last step is filled; nothing more will be consumed."""
    NOT_NEWEST = "not_newest"
    """A version older than the newest was asked for and admitting old versions is off."""
    NO_CAPACITY = "no_capacity"
    """No instance has room (recorded by the driver; the queue never returns it)."""


class GroupState(enum.Enum):
    ADMITTED = "admitted"
    """Bound to a version, no token sampled yet: may be re-bound."""
    STARTED = "started"
    """Running; its version is frozen."""
    COMPLETED = "completed"
    """Done and scored, waiting for a step."""
    ASSIGNED = "assigned"
    """Assigned to a step, kept until that step is durable."""


@dataclass(frozen=True, slots=True)
class Admitted:
    group_id: str
    version: int
    deadline: int


@dataclass(frozen=True, slots=True)
class Refused:
    reason: RefusalReason


Refusal = Refused
"""Alias: the refusal outcome of `try_admit`."""


@dataclass(frozen=True, slots=True)
class Assigned:
    """Group `group_id` (sampled by `version`) trains at step `step`."""

    group_id: str
    step: int
    version: int


@dataclass(frozen=True, slots=True)
class FailureOutcome:
    """What `fail` decided: retry the group at its version, or mask it (it completes with masked
    samples, and `assigned` lists what that completion unlocked)."""

    group_id: str
    retried: bool
    assigned: tuple[Assigned, ...]


@dataclass(frozen=True, slots=True)
class RollbackReport:
    """The result of `rollback`: ghost groups removed (abort them), groups offered again (their
    earlier assignments are void), and the assignments made under the new incarnation."""

    step: int
    incarnation: int
    rolled_back: tuple[str, ...]
    reoffered: tuple[str, ...]
    ghost_versions: tuple[int, ...]
    assigned: tuple[Assigned, ...]


@dataclass(frozen=True, slots=True)
class VersionCounts:
    admitted: int
    started: int
    completed: int
    assigned: int


@dataclass(frozen=True, slots=True)
class Accounting:
    """admitted == consumed + filtered + rolled_back + unassigned, always."""

    admitted: int
    consumed: int
    filtered: int
    rolled_back: int
    unassigned: int
    masked: int
    retried: int
    reoffered: int
    ignored_messages: int
    restarted: int = 0
    """Groups whose episodes were lost with a `dora serve` that died, started again (`restart`)."""
