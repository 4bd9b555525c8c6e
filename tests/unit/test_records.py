"""The records of a run directory read back as they were written, a metric that is not finite
included (the emulated trainer's `ratio_min` of a step without a backward pass is infinite)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from dora.bench.proc import TrainedCounter
from dora.records import (
    Trained,
    TrainerStep,
    read_records,
    read_trainer_steps,
    write_trainer_step,
)
from dora.serve.metrics import MetricsLog


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
