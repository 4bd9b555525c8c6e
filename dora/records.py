"""The records a run directory holds, one msgspec struct per kind, and the one reader of each file.

- `rollout.jsonl` (serve): `MetricsLog.write` takes a `Record` and writes `{"kind": ..., "time_s":
  ..., <fields>}`; `read_records` decodes the file back into these types (lines of other kinds,
  and lines torn by a kill, are skipped). `dora/serve/metrics.py` says when each is written.
- `summary.json` (serve, at the end): a `RolloutReport` without its `kind` and `time_s`;
  `write_summary`, `read_summary`.
- `learn-metrics.jsonl` (the trainer, per step): `TrainerStep`, written flat as `{"step", "time",
  <metric>...}` by `write_trainer_step` and read by `read_trainer_steps`.
- `consumed.jsonl` (the emulated trainer, per consumed group): `Consumed`; `read_consumed`.

The field names are the files', so `dora report`, the benches, the run checks and earlier run
directories read them as before. The module stands outside serve because learn and the emulated
backend, which may not import serve, write and read them too.
"""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

import msgspec

__all__ = [
    "Budget",
    "Consumed",
    "Drain",
    "Eval",
    "InstanceFailed",
    "InstanceRestartFailed",
    "InstanceRestarted",
    "InstanceTick",
    "InstanceUnresponsive",
    "LinkCounts",
    "Masked",
    "NcclFallback",
    "Record",
    "RequestFailed",
    "Restore",
    "Rollback",
    "RolloutReport",
    "RunnerLost",
    "ServeStart",
    "Step",
    "Tick",
    "TickEval",
    "Trained",
    "TrainerStep",
    "Undrain",
    "WeightLoad",
    "WeightLoadTimeout",
    "decode_record",
    "read_consumed",
    "read_records",
    "read_summary",
    "read_trainer_steps",
    "write_summary",
    "write_trainer_step",
]


class Record(msgspec.Struct, kw_only=True, tag_field="kind"):
    """One line of `rollout.jsonl` (the `kind` is the struct's tag)."""

    time_s: float = 0.0
    """Seconds since the log was opened; `MetricsLog.write` sets it."""


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
    metrics: dict[str, float | None]
    """The trainer's metrics of the step (its `StepDone`); None where the value was not finite
    (JSON has no infinity or NaN: the log writes them as `null`)."""

    def numbers(self) -> dict[str, float]:
        """`metrics`, with NaN for a value that was not finite."""
        return {k: math.nan if v is None else v for k, v in self.metrics.items()}


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


class RunnerLost(Record, tag="runner_lost"):
    """An episode runner exited or went silent; its `episodes` run again elsewhere."""

    runner: str
    reason: str
    episodes: int


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
    under_calls: int = 0
    """Calls that were running on the instance when the load began and went on under the new
    weights with the KV cache of the old (mode `inflight`); 0 where a load waits for the
    instance to empty, or loads an adapter beside calls that keep their own version."""


class WeightLoadTimeout(Record, tag="weight_load_timeout"):
    instance: str
    version: int
    attempt: int
    error: str


class NcclFallback(Record, tag="nccl_fallback"):
    """A version that was to reach `instances` by an NCCL broadcast, and why it did not: they
    load it from the weight store instead."""

    version: int
    instances: list[str]
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
    success_at: float = 1.0
    off_version_tokens: float = 0.0
    temperature: float = 0.0
    samples_per_task: int = 1
    pass_at_k: float | None = None


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
    cpu_s: float = 0.0
    """CPU seconds of the serve process (all its threads) since it started."""
    runner_cpu_s: float = 0.0
    """CPU seconds of the episode runners' processes (`serve.runners`, attached ones too), as
    each last reported them (with its heartbeat and each result)."""
    peak_rss_mb: float = 0.0
    """The most resident memory the serve process has held so far (MB)."""
    loop_stall_ms: float = 0.0
    """The longest any wake-up of serve's event loop waited since the previous tick (a probe
    sleeping 10 ms at a time); `loop_lag_ms` is how late this tick itself woke."""
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
    max_loop_stall_ms: float = 0.0
    """The longest event-loop stall any tick saw (`Tick.loop_stall_ms`)."""
    tick_versions_serving: int = 0
    """Most versions with calls in flight seen by a metrics tick (coarser than the router's)."""
    masked_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    """Masked samples by what failed (`reset raised KeyError`, `reward`, ...); `extra` holds
    their total (`masked_samples`)."""
    extra: dict[str, float] = msgspec.field(default_factory=dict)
    core_s_by_call: dict[str, float] = msgspec.field(default_factory=dict)
    """Seconds spent in each method of the transfer queue (journal writes included) and the
    orchestrator over the run, as `Type.method`: what the ticks' `core_s` is made of."""
    model_calls: int = 0
    """Generate calls serve made (`dora.instance.callcpu`)."""
    call_cpu_s: dict[str, float] = msgspec.field(default_factory=dict)
    """Serve's thread CPU spent on those calls, by part (`request`, `answer`, `turn`)."""


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
    | RunnerLost
    | InstanceFailed
    | InstanceUnresponsive
    | InstanceRestartFailed
    | InstanceRestarted
    | WeightLoad
    | WeightLoadTimeout
    | NcclFallback
    | Eval
    | Tick
    | RolloutReport
)
_KINDS = {t.__struct_config__.tag for t in typing.get_args(_Known)}


class _Kind(msgspec.Struct):
    kind: str = ""


_kind_of = msgspec.json.Decoder(_Kind).decode
_decode = msgspec.json.Decoder(_Known).decode


def decode_record(line: bytes) -> Record | None:
    """One line of `rollout.jsonl` as its struct; None for another kind or a line that does not
    decode (torn by a kill, or written before a field existed)."""
    try:
        if _kind_of(line).kind in _KINDS:
            return _decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    return None


def read_records(path: Path, *, kinds: set[str] | None = None) -> list[Record]:
    """The records of a `rollout.jsonl` (of `kinds` only, if given) as their structs; lines that
    `decode_record` refuses are skipped."""
    if not path.is_file():
        return []
    out: list[Record] = []
    with path.open("rb") as f:
        for line in f:
            record = decode_record(line)
            if record is not None and (kinds is None or record.__struct_config__.tag in kinds):
                out.append(record)
    return out


def write_summary(path: Path, report: RolloutReport) -> None:
    """`summary.json`: the `summary` record without its `kind` and `time_s`, indented."""
    fields = msgspec.structs.asdict(report)
    del fields["time_s"]
    path.write_bytes(msgspec.json.format(msgspec.json.encode(fields)))


def read_summary(path: Path) -> RolloutReport | None:
    """`summary.json` (written by a serve that finished), or None when missing or unreadable."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=RolloutReport)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


class TrainerStep(msgspec.Struct, kw_only=True):
    """One line of `learn-metrics.jsonl`: a trained step and the trainer's metrics of it."""

    step: int
    time: float
    """Wall-clock (Unix) time the step ended."""
    metrics: dict[str, float]
    """`StepDone.metrics` (`dora/learn/metrics.py`); written flat beside `step` and `time`."""


def write_trainer_step(path: Path, record: TrainerStep) -> None:
    """Append `record` to `learn-metrics.jsonl`, flat: `{"step", "time", <metric>...}`.

    With the standard library's JSON, which writes a metric with no value yet (`ratio_max` of a
    step without tokens, say) as `Infinity`/`NaN` where msgspec would write `null`."""
    line = {"step": record.step, "time": record.time, **record.metrics}
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def read_trainer_steps(path: Path) -> list[TrainerStep]:
    """The steps of a `learn-metrics.jsonl`, in file order; lines that do not decode are skipped
    (the last one, while the trainer writes it)."""
    if not path.is_file():
        return []
    out: list[TrainerStep] = []
    with path.open("rb") as f:
        for line in f:
            try:
                metrics = msgspec.convert(json.loads(line), dict[str, float])
            except (ValueError, msgspec.ValidationError):
                continue
            if "step" in metrics and "time" in metrics:
                step, time = int(metrics.pop("step")), metrics.pop("time")
                out.append(TrainerStep(step=step, time=time, metrics=metrics))
    return out


class Consumed(msgspec.Struct, kw_only=True):
    """One line of `consumed.jsonl`: a group the emulated trainer consumed."""

    step: int
    group: str
    version: int
    incarnation: int
    samples: int
    masked: int
    token_versions: list[int]
    """The versions that sampled its tokens, sorted (C1 is checked on these)."""


def read_consumed(path: Path) -> list[Consumed]:
    """The lines of a `consumed.jsonl`, in file order; lines that do not decode are skipped."""
    if not path.is_file():
        return []
    decode = msgspec.json.Decoder(Consumed).decode
    out: list[Consumed] = []
    with path.open("rb") as f:
        for line in f:
            try:
                out.append(decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
    return out
