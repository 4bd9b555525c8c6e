"""The orchestrator's vocabulary: the modes, the actions it returns (the driver carries them out
in order), why a request fails, and the read-only view of an instance. Plain frozen dataclasses
and enums, so that a driver can pattern-match on them and a log can store them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Action",
    "Drain",
    "Fail",
    "FailReason",
    "InstanceView",
    "Load",
    "Migrate",
    "Mode",
    "Park",
    "Resume",
    "Undrain",
    "Unload",
]


class Mode(enum.Enum):
    SYNC = "sync"
    ONE_STEP_OFF = "one_step_off"
    PARTIAL = "partial"
    DORA = "dora"
    INFLIGHT = "inflight"


@dataclass(frozen=True, slots=True)
class Load:
    """Load `version` on `instance` (it holds no request). When done, report this very value
    to `on_loaded`: `id` names the load, so a completion of an earlier load of the same
    instance (the target changed and changed back, or a roll-back made it a ghost's) is told
    apart and ignored. The orchestrator numbers its loads from 1; 0 names none."""

    instance: str
    version: int
    id: int = 0


@dataclass(frozen=True, slots=True)
class Unload:
    """Drop `version` from multi-version `instance` (it holds versions as adapters): no live
    request of `version` is left anywhere, and it is neither the newest nor version 0 (the base
    model itself, which an adapter-capable instance always holds)."""

    instance: str
    version: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop placing new groups on `instance`; it switches version once its requests end."""

    instance: str


@dataclass(frozen=True, slots=True)
class Undrain:
    """`instance` accepts new groups again: a drain ended without a version switch (a `Load`
    also ends a drain; the instance accepts groups once `on_loaded` is reported)."""

    instance: str


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move `request` (tokens so far, and its KV cache if the backend can) from `src` to `dst`,
    an instance of the same version. `src` may be an instance that died."""

    request: str
    src: str
    dst: str


@dataclass(frozen=True, slots=True)
class Park:
    """Interrupt `request` on `instance` (abort, keep the tokens so far) until a `Resume`."""

    request: str
    instance: str


@dataclass(frozen=True, slots=True)
class Resume:
    """Continue parked `request` on `instance`, which holds `version` (the request's own version,
    except in partial mode)."""

    request: str
    instance: str
    version: int


class FailReason(enum.Enum):
    """Why a request can run on no instance (`Fail`)."""

    TOO_LONG = "too_long"
    """Its context (`set_size`) is longer than every instance's KV-token capacity."""


@dataclass(frozen=True, slots=True)
class Fail:
    """`request` can run on no instance (`reason`): end its episode as failed (the group's
    failure policy applies: retry or mask) and `finish` it as usual. It is parked until then
    (a `Park` comes first if it was running) and never resumed."""

    request: str
    reason: FailReason


Action = Load | Unload | Drain | Undrain | Migrate | Park | Resume | Fail


@dataclass(frozen=True, slots=True)
class InstanceView:
    id: str
    capacity: int
    version: int | None
    ready: bool
    draining: bool
    load: int
