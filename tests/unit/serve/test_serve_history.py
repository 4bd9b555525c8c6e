"""A restored serve's view of what the serves before it recorded in `rollout.jsonl`."""

from __future__ import annotations

from pathlib import Path

from dora.records import (
    InstanceFailed,
    InstanceRestarted,
    Masked,
    Record,
    ServeStart,
    WeightLoad,
)
from dora.serve.history import masked_by_source, masked_reason, read_history
from dora.serve.metrics import MetricsLog
from tests.unit.bench.fixtures import eval_record


def test_history_sums_the_earlier_serves_and_skips_a_torn_line(tmp_path: Path) -> None:
    records: list[Record] = [
        ServeStart(serve_start=1, unix_time=1000.0),
        eval_record(1.5, step=0, accuracy=0.25),
        InstanceFailed(instance="i1"),
        WeightLoad(instance="i2", version=1, seconds=0.1),
        InstanceRestarted(instance="i2", replaces="i1"),
        Masked(group="g1", samples=2, reasons={"reward": 2}),
        ServeStart(serve_start=2, unix_time=1050.0),
        eval_record(60.0, step=4, accuracy=0.5),
        InstanceFailed(instance="i1"),
        Masked(group="g9", samples=1, reasons={"reset raised KeyError": 1}),
    ]
    log = MetricsLog(tmp_path)
    for record in records:
        log.write(record)
    log.close()
    path = tmp_path / "rollout.jsonl"
    with path.open("a") as f:
        f.write('{"kind": "tick", "step": 1}\n{"kind": "instance_fai')  # another kind; torn
    h = read_history(path)
    assert h.started_unix == 1000.0
    assert h.instances_failed == ["i1@serve1", "i1@serve2"] and h.instance_restarts == 1
    assert h.masked_samples == 3
    assert h.masked_reasons == {"reward": 2, "reset raised KeyError": 1}
    assert h.first_eval == (0, 0.25)
    assert read_history(tmp_path / "none.jsonl").started_unix is None


def test_masked_reasons_name_what_failed() -> None:
    assert masked_reason({"error": "reward: reward is not finite: nan"}, "error") == "reward"
    reset = {"error": "reset raised KeyError: 'x'"}
    assert masked_reason(reset, "error") == "reset raised KeyError"
    assert masked_reason({"error": "step() must return (text, done: bool)"}, "error") == "step"
    assert masked_reason({}, "context") == "context"


def test_masked_samples_are_counted_apart_by_who_failed() -> None:
    refused = {"error": "the sampler ended the request with 'error' (env E, task t1)"}
    reasons = {
        masked_reason(refused, "error"): 2,
        masked_reason({"error": "reward timed out after 1 s (env E, task t2)"}, "error"): 3,
        masked_reason({"error": "encoding reset()'s prompt raised TypeError: x"}, "error"): 1,
        "error": 1,  # a sample masked with the instance's own finish reason and no error
    }
    assert masked_by_source(reasons) == {"environment": 4, "instance": 3}
