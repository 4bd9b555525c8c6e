"""What earlier `dora serve` processes of this run recorded, so that a restored serve's summary
covers the whole run and not only its own life.

A serve killed mid-run never writes its summary; what it did lives in `rollout.jsonl` (appended
by every serve of the run, one record per line, flushed as written). A serve that restores its
journal reads that file once at start (`read_history`) and adds to its own summary: the
instances that failed earlier (named `i0@serve1`: ids start again at `i0` in every serve), the
replacements started, the masked samples and their reasons, the first evaluation, and the run's
start (from the first `serve_start` record), so `wall_s` is the wall time of the whole run.

A line that does not decode (the one being written when a serve was killed) is skipped.

Masked samples are counted by what failed (`masked_reason`); a step whose every sample is masked
stops the run (`check_not_all_masked`): it would train on nothing, and a run that went on would
report success having learnt nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dora.episode import SAMPLER_ENDED
from dora.errors import AllMasked
from dora.protocol import Sample
from dora.records import (
    Eval,
    InstanceFailed,
    InstanceRestarted,
    Masked,
    ServeStart,
    read_records,
)

__all__ = [
    "History",
    "check_not_all_masked",
    "masked_by_source",
    "masked_reason",
    "masked_reasons",
    "read_history",
]


@dataclass
class History:
    """The records of the serves before this one (empty for the first serve of a run)."""

    started_unix: float | None = None
    """Wall-clock time the run's first serve started (its `serve_start` record)."""
    instances_failed: list[str] = field(default_factory=list)
    instance_restarts: int = 0
    masked_samples: int = 0
    masked_reasons: dict[str, int] = field(default_factory=dict)
    first_eval: tuple[int, float] | None = None
    """(version, accuracy) of the run's first evaluation."""


def read_history(path: Path) -> History:
    """Read `rollout.jsonl` as the earlier serves left it."""
    out = History()
    if not path.exists():
        return out
    serve = 1
    for record in read_records(path):
        match record:
            case ServeStart(serve_start=serve, unix_time=unix_time):
                if out.started_unix is None:
                    out.started_unix = unix_time
            case InstanceFailed(instance=instance):
                out.instances_failed.append(f"{instance}@serve{serve}")
            case InstanceRestarted():
                out.instance_restarts += 1
            case Masked(samples=n, reasons=reasons):
                out.masked_samples += n
                for reason, k in reasons.items():
                    out.masked_reasons[reason] = out.masked_reasons.get(reason, 0) + k
            case Eval(version=version, accuracy=accuracy) if out.first_eval is None:
                out.first_eval = (version, accuracy)
    return out


def masked_reason(metadata: dict[str, str], finish_reason: str) -> str:
    """Why a sample was masked, as a short counted key: what failed, from the head of the
    sample's error (`reset raised KeyError`, `reward timed out after 60 s`, `env factory raised
    TypeError`, ...: the hook and the cause; the environment and the task follow in the error);
    without an error, its finish reason (`error`: the instance refused the request; `context`)."""
    error = metadata.get("error", "")
    head = error.partition(":")[0].partition("(")[0].strip()
    return head[:60] if head else finish_reason


def masked_by_source(reasons: dict[str, int]) -> dict[str, int]:
    """Masked samples split by who failed, from their `masked_reason` counts: `environment` (a
    hook of the user's environment, its data, or text the tokenizer refused) or `instance` (an
    inference instance refused or abandoned the call). Calls lost with a dead instance are not
    here: they are resubmitted to another instance of the same version (`resubmissions`)."""
    out = {"environment": 0, "instance": 0}
    for reason, n in reasons.items():
        by_instance = reason.startswith(SAMPLER_ENDED) or reason == "error"
        out["instance" if by_instance else "environment"] += n
    return out


def masked_reasons(samples: list[Sample]) -> dict[str, int]:
    """How many of `samples` are masked, by `masked_reason`."""
    reasons: dict[str, int] = {}
    for s in samples:
        if s.masked:
            reason = masked_reason(s.metadata, s.finish_reason)
            reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def check_not_all_masked(step: int, samples: list[Sample], *, env: str) -> None:
    """EnvError naming the most common cause if every sample of `step` is masked."""
    if not samples or not all(s.masked for s in samples):
        return
    reasons = masked_reasons(samples)
    cause = max(reasons, key=lambda r: reasons[r])
    example = next((s.metadata["error"] for s in samples if "error" in s.metadata), "no error")
    raise AllMasked(
        f"every one of the {len(samples)} samples of step {step} was masked ({reasons}); "
        f"the most common cause: {cause!r}, e.g. {example[:300]!r}. Fix the environment "
        f"(env.cls = {env}) or the instances before training on"
    )
