"""`dora bench trl`: TRL gets the config's settings, and dora's curve is read from its records."""

from __future__ import annotations

from pathlib import Path

import msgspec

from dora.bench.trl import dora_curve, grpo_args, summary_lines
from dora.config import load_config
from dora.records import Trained
from dora.report import plot_accuracy_vs_time
from tests.unit.bench.fixtures import eval_record

ROOT = Path(__file__).resolve().parents[3]


def test_trl_gets_the_same_workload_settings(tmp_path: Path) -> None:
    config = load_config(ROOT / "examples/math/config.toml", ["learn.steps=7"])
    args = grpo_args(config, tmp_path)
    assert args["per_device_train_batch_size"] == 8 * 8 and args["num_generations"] == 8
    assert args["gradient_accumulation_steps"] == 1  # one optimizer step per 8 prompts
    assert args["max_completion_length"] == 128 and args["temperature"] == 0.6
    assert args["learning_rate"] == 3e-5 and args["max_steps"] == 7
    assert (args["epsilon"], args["epsilon_high"], args["beta"]) == (0.2, 0.28, 0.0)
    assert args["loss_type"] == "dapo" and args["scale_rewards"] == "group"  # token-level GRPO
    assert args["top_k"] == 0 and args["top_p"] == 1.0
    sequence = grpo_args(load_config(None, ["learn.aggregation=sequence"]), tmp_path)
    assert sequence["loss_type"] == "grpo"


def test_dora_curve_puts_each_version_at_the_time_its_last_step_trained(tmp_path: Path) -> None:
    records = [
        eval_record(1.0, step=0, accuracy=0.25),
        Trained(time_s=4.0, step=0, metrics={}),
        Trained(time_s=6.0, step=1, metrics={}),
        eval_record(7.5, step=2, accuracy=0.5),
    ]
    (tmp_path / "rollout.jsonl").write_bytes(
        b"".join(msgspec.json.encode(r) + b"\n" for r in records)
    )
    assert dora_curve(tmp_path, 2) == {
        "steps": 2,
        "seconds": 6.0,
        "curve": [
            {"version": 0, "seconds": 0.0, "accuracy": 0.25},
            {"version": 2, "seconds": 6.0, "accuracy": 0.5},
        ],
    }


def test_summary_prints_each_curve_and_the_steps_per_second_ratio(tmp_path: Path) -> None:
    results = {
        "dora": {
            "steps": 300,
            "seconds": 120.0,
            "curve": [{"version": 0, "seconds": 0.0, "accuracy": 0.5}],
        },
        "trl": {
            "steps": 300,
            "seconds": 360.0,
            "curve": [{"version": 0, "seconds": 0.0, "accuracy": 0.5}],
        },
    }
    lines = summary_lines(results)
    assert lines[0] == "dora: 2.500 steps/s; held-out accuracy v0 0.500 @ 0 s"
    assert lines[1].startswith("trl: 0.833 steps/s")
    assert lines[-1] == "dora/trl steps/s ratio: 3.00"
    assert not any("ratio" in line for line in summary_lines({"trl": results["trl"]}))
    png = tmp_path / "curves.png"
    plot_accuracy_vs_time(
        {name: [(p["seconds"], p["accuracy"]) for p in r["curve"]] for name, r in results.items()},
        png,
        title="t",
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trl_prompt_ids_are_the_prompt_dora_samples_from() -> None:
    from dora.bench.trl import trl_prompt_ids
    from dora.models.tiny import char_tokenizer
    from dora.render import ChatRenderer

    tok = char_tokenizer()
    base = char_tokenizer(base=True)
    messages = [{"role": "user", "content": "2+2="}]
    for t in (tok, base):  # plain text: tokenizer(prompt), the base model's <s> included
        assert trl_prompt_ids(t, "2+2=") == ChatRenderer(t).prompt_ids("2+2=", [])
    assert trl_prompt_ids(tok, messages) == ChatRenderer(tok).prompt_ids(messages, [])
