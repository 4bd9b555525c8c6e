"""The records of a run directory read back as they were written, a metric that is not finite
included (the emulated trainer's `ratio_min` of a step without a backward pass is infinite)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec

from dora.bench.proc import TrainedCounter
from dora.records import (
    Trained,
    TrainerStep,
    read_records,
    read_summary,
    read_trainer_steps,
    write_summary,
    write_trainer_step,
)
from dora.serve.metrics import MetricsLog
from tests.unit.bench.fixtures import summary_record


def test_a_trained_record_with_an_infinite_metric_reads_back(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    log.write(Trained(step=0, metrics={"tokens": 12.0, "ratio_min": math.inf}))
    log.close()
    line = json.loads((tmp_path / "rollout.jsonl").read_text())
    assert list(line)[:2] == ["kind", "time_s"] and line["metrics"]["ratio_min"] is None
    [record] = read_records(tmp_path / "rollout.jsonl")
    assert isinstance(record, Trained) and record.step == 0 and record.time_s >= 0.0
    numbers = record.numbers()
    assert numbers["tokens"] == 12.0 and math.isnan(numbers["ratio_min"])
    assert TrainedCounter(tmp_path / "rollout.jsonl").poll() == 1


def test_learn_metrics_keep_their_flat_format_and_infinities(tmp_path: Path) -> None:
    path = tmp_path / "learn-metrics.jsonl"
    write_trainer_step(path, TrainerStep(step=3, time=1.5, metrics={"ratio_min": math.inf}))
    assert json.loads(path.read_text()) == {"step": 3, "time": 1.5, "ratio_min": math.inf}
    assert read_trainer_steps(path) == [
        TrainerStep(step=3, time=1.5, metrics={"ratio_min": math.inf})
    ]


def test_summary_json_is_the_summary_record_without_kind_and_time(tmp_path: Path) -> None:
    report = summary_record(time_s=7.0, steps=3, extra={"consumed": 6.0})
    write_summary(tmp_path / "summary.json", report)
    fields = json.loads((tmp_path / "summary.json").read_text())
    assert "kind" not in fields and "time_s" not in fields and fields["steps"] == 3
    assert read_summary(tmp_path / "summary.json") == msgspec.structs.replace(report, time_s=0.0)
    (tmp_path / "torn.json").write_text('{"mode": "do')
    assert read_summary(tmp_path / "torn.json") is None
    assert read_summary(tmp_path / "missing.json") is None
