"""The run's console lines and end table, from the records `rollout.jsonl` holds."""

from __future__ import annotations

from dora.serve.console import StepLines, summary_table


def _trained(step: int, time_s: float, **metrics: float) -> dict[str, object]:
    base = {"tokens": 1000.0, "version": float(step + 1), "reward_mean": 0.5, "loss": 0.25}
    base |= {"staleness_mean": 1.5, "staleness_max": 2.0}
    return {"kind": "trained", "time_s": time_s, "step": step, "metrics": base | metrics}


def test_a_line_every_n_steps_and_at_the_last_with_rate_wait_and_held_out() -> None:
    lines: list[str] = []
    console = StepLines(every=2, total_steps=5, emit=lines.append)
    console.observe({"kind": "tick", "time_s": 0.0, "trainer_wait_s": 0.0})
    console.observe(_trained(0, 1.0))
    console.observe({"kind": "tick", "time_s": 1.5, "trainer_wait_s": 0.75})
    console.observe(_trained(1, 2.0, reward_mean=0.625))
    assert lines == [
        "step 2/5  v2  reward 0.625  loss 0.25  tokens/s 1,000  staleness 1.5 (max 2)  "
        "trainer wait 0.8 s"
    ]
    console.observe(_trained(2, 3.0))
    console.observe({"kind": "eval", "version": 3, "reward_mean": 0.4, "accuracy": 0.25})
    console.observe(_trained(3, 4.0))  # two steps' tokens over the two seconds since the last line
    assert lines[-1].startswith("step 4/5  v4  ")
    assert "tokens/s 1,000" in lines[-1] and "trainer wait 0.0 s" in lines[-1]
    assert lines[-1].endswith("held-out reward 0.400, success 25.0% (v3)")
    console.observe(_trained(4, 5.0))  # the last step always gets its line
    assert len(lines) == 3 and lines[-1].startswith("step 5/5") and "held-out" not in lines[-1]


def test_other_records_print_nothing() -> None:
    lines: list[str] = []
    console = StepLines(every=1, total_steps=3, emit=lines.append)
    for kind in ("step", "weight_load", "rollback", "masked", "summary"):
        console.observe({"kind": kind, "time_s": 1.0})
    assert lines == []


def test_the_end_table_reads_the_accounting_and_the_held_out_change() -> None:
    report = {
        "mode": "dora",
        "steps": 20,
        "steps_trained": 20,
        "wall_s": 61.25,
        "trainer_wait_s": 3.5,
        "max_versions_serving": 3,
        "extra": {
            "admitted": 170,
            "consumed": 160,
            "filtered": 4,
            "rolled_back": 6,
            "unassigned": 0,
            "masked_samples": 2,
            "eval_first_version": 0,
            "eval_first_accuracy": 0.125,
            "eval_last_version": 20,
            "eval_last_accuracy": 0.5,
        },
    }
    table = summary_table(report).splitlines()
    assert "steps trained          20 of 20" in table[1]
    assert table[3].endswith("170 admitted = 160 trained + 4 filtered + 6 rolled back + 0 left")
    assert table[-1].endswith("12.5% (v0) -> 50.0% (v20)")
    assert "held-out" not in summary_table({**report, "extra": {}})
