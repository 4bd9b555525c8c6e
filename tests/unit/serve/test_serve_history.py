"""A restored serve's view of what the serves before it recorded in `rollout.jsonl`."""

from __future__ import annotations

import json
from pathlib import Path

from dora.serve.history import masked_reason, read_history


def test_history_sums_the_earlier_serves_and_skips_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "rollout.jsonl"
    records = [
        {"kind": "serve_start", "serve_start": 1, "unix_time": 1000.0},
        {"kind": "eval", "version": 0, "accuracy": 0.25},
        {"kind": "instance_failed", "instance": "i1"},
        {"kind": "instance_restarted", "instance": "i2", "replaces": "i1"},
        {"kind": "masked", "group": "g1", "samples": 2, "reasons": {"reward": 2}},
        {"kind": "serve_start", "serve_start": 2, "unix_time": 1050.0},
        {"kind": "eval", "version": 4, "accuracy": 0.5},
        {"kind": "instance_failed", "instance": "i1"},
        {"kind": "masked", "group": "g9", "samples": 1, "reasons": {"reset raised KeyError": 1}},
    ]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"kind": "instance_fai'
    path.write_text(text)
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
