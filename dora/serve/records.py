"""The records of `rollout.jsonl`, one msgspec struct per kind.

`MetricsLog.write` takes one of these and writes `{"kind": ..., "time_s": ..., <fields>}`; the
field names are the file's, so `dora report`, the benches and earlier run directories read it as
before. `read_records` decodes a file back into these types (lines of other kinds, and lines torn
by a kill, are skipped). `metrics.py` says when each record is written.
"""

from __future__ import annotations

import typing
from pathlib import Path

import msgspec

__all__ = [
    "Budget",
    "Drain",
    "Eval",
    "InstanceFailed",
    "InstanceRestartFailed",
    "InstanceRestarted",
    "InstanceTick",
    "InstanceUnresponsive",
    "LinkCounts",
    "Masked",
    "Record",
    "RequestFailed",
    "Restore",
    "Rollback",
    "RolloutReport",
    "ServeStart",
    "Step",
    "Tick",
    "TickEval",
    "Trained",
    "Undrain",
    "WeightLoad",
    "WeightLoadTimeout",
    "read_records",
]


class Record(msgspec.Struct, kw_only=True, tag_field="kind"):
    """One line of `rollout.jsonl` (the `kind` is the struct's tag; `time_s` is added when it is
    written: seconds since the log was opened)."""


class ServeStart(Record, tag="serve_start"):
    serve_start: int
    """Which start of `dora serve` on this run directory (1: the first)."""
    unix_time: float


class Restore(Record, tag="restore"):
    """What the journal held when a restarted serve replayed it."""

    serve_start: int
    step: int
    incarnation: int
    groups_held: int
    lost: int
    admitted: int
    consumed: int
    rolled_back: int


class Trained(Record, tag="trained"):
    step: int
    metrics: dict[str, float]
    """The trainer's metrics of the step (its `StepDone`)."""


class Step(Record, tag="step"):
    """A step's last group went out."""

    step: int
    groups: list[str]
    versions: list[int]
    staleness: list[int]
    fill_s: float


class Rollback(Record, tag="rollback"):
    incarnation: int
    step: int
    rolled_back: int


class Masked(Record, tag="masked"):
    group: str
    samples: int
    reasons: dict[str, int]


class Budget(Record, tag="budget"):
    max_minutes: float
    last_step: int


class _OfInstance(Record):
    instance: str


class _InstanceError(_OfInstance):
    error: str


class Drain(_OfInstance, tag="drain"):
    """The orchestrator drains the instance (no new groups)."""


class Undrain(_OfInstance, tag="undrain"):
    pass


class RequestFailed(Record, tag="request_failed"):
    lease: str
    reason: str


class InstanceFailed(_OfInstance, tag="instance_failed"):
    """The instance was found unreachable."""


class InstanceUnresponsive(_InstanceError, tag="instance_unresponsive"):
    """The instance missed its health deadline."""


class InstanceRestartFailed(_InstanceError, tag="instance_restart_failed"):
    pass


class InstanceRestarted(_OfInstance, tag="instance_restarted"):
    replaces: str


class WeightLoad(Record, tag="weight_load"):
    instance: str
    version: int
    seconds: float


class WeightLoadTimeout(Record, tag="weight_load_timeout"):
    instance: str
    version: int
    attempt: int
    error: str


class Eval(Record, tag="eval"):
    """One evaluation (`evaluate.py` says what each field means)."""

    step: int
    version: int
    due: int | None
    due_s: float | None
    accuracy: float
    reward_mean: float
    n: int
    masked: int
    concurrency: int
    version_time_s: float | None
    started_s: float
    seconds: float


class InstanceTick(msgspec.Struct, kw_only=True):
    id: str
    version: int | None
    ready: bool
    draining: bool
    leases: int
    capacity: int
    inflight: int
    util: float
    tokens: int


class LinkCounts(msgspec.Struct, kw_only=True):
    sent_messages: int = 0
    sent_bytes: int = 0
    received_messages: int = 0
    received_bytes: int = 0


class TickEval(msgspec.Struct, kw_only=True):
    version: int
    accuracy: float


class Tick(Record, tag="tick", omit_defaults=True):
    """A snapshot of the running serve (`snapshots.py`); `eval` only once one finished."""

    step: int
    trained: int
    newest: int | None
    published: int
    instances: list[InstanceTick]
    live_per_version: dict[int, int]
    serving_versions: dict[int, int]
    episodes_per_version: dict[int, dict[str, int]]
    queue_per_version: dict[int, dict[str, int]]
    staleness_histogram: list[int]
    admitted: int
    completed: int
    assigned: int
    masked: int
    retried: int
    rolled_back: int
    migrations: int
    kv_migrations: int
    resubmissions: int
    parks: int
    missed_interrupts: int
    failed_calls: int
    instances_failed: list[str]
    weight_loads: int
    weight_load_s: float
    weights_held: list[int]
    admission_wait_s: dict[str, float]
    trainer_wait_s: float
    loop_lag_ms: float
    core_s: float
    core_calls: int
    journal_writes: int
    journal_bytes: int
    link: LinkCounts
    eval: TickEval | None = None


class RolloutReport(Record, tag="summary"):
    """What a finished run did: the `summary` record (also `summary.json`, without `kind`)."""

    mode: str
    steps: int
    groups_sent: int
    wall_s: float
    max_versions_serving: int
    """Most distinct versions with calls in flight at the same moment (exact, from the router)."""
    utilisation: dict[str, float]
    """Per instance: the fraction of the run with at least one call running."""
    staleness_histogram: list[int]
    migrations: int
    kv_migrations: int
    resubmissions: int
    parks: int
    missed_interrupts: int
    failed_calls: int
    instances_failed: list[str]
    weight_loads: int
    weight_load_s: float
    admission_wait_s: dict[str, float]
    trainer_wait_s: float
    max_loop_lag_ms: float
    steps_trained: int
    tick_versions_serving: int = 0
    """Most versions with calls in flight seen by a metrics tick (coarser than the router's)."""
    masked_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    """Masked samples by what failed (`reset raised KeyError`, `reward`, ...); `extra` holds
    their total (`masked_samples`)."""
    extra: dict[str, float] = msgspec.field(default_factory=dict)


_Known = (
    ServeStart
    | Restore
    | Trained
    | Step
    | Rollback
    | Masked
    | Budget
    | Drain
    | Undrain
    | RequestFailed
    | InstanceFailed
    | InstanceUnresponsive
    | InstanceRestartFailed
    | InstanceRestarted
    | WeightLoad
    | WeightLoadTimeout
    | Eval
    | Tick
    | RolloutReport
)
_KINDS = {t.__struct_config__.tag for t in typing.get_args(_Known)}


class _Kind(msgspec.Struct):
    kind: str = ""


def read_records(path: Path, *, kinds: set[str] | None = None) -> list[Record]:
    """The records of a `rollout.jsonl` (of `kinds` only, if given) as their structs; lines of
    another kind, or that do not decode (torn by a kill, or written before a field existed), are
    skipped."""
    if not path.exists():
        return []
    kind_of = msgspec.json.Decoder(_Kind).decode
    decode = msgspec.json.Decoder(_Known).decode
    out: list[Record] = []
    with path.open("rb") as f:
        for line in f:
            try:
                kind = kind_of(line).kind
                if kind in _KINDS and (kinds is None or kind in kinds):
                    out.append(decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
    return out
