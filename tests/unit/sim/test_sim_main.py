"""`dora simulate` end to end: tables, JSON, the timeline PNG, the last line, and clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dora.cli import main


def test_simulate_writes_json_and_plot_and_ends_with_the_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "sim.json"
    out_png = tmp_path / "timeline.png"
    argv = ["simulate", "--preset", "paper-64", "--steps", "3", "--instances", "8"]
    argv += ["--json", str(out_json), "--plot", str(out_png), "--seed", "3"]
    argv += ["groups_per_step=64", "max_seqs=64"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    lines = text.rstrip("\n").splitlines()
    assert re.fullmatch(r"dora/sync throughput ratio: \d+\.\d\d", lines[-1])
    for mode in ("sync", "one_step_off", "partial", "dora", "inflight"):
        assert f": {mode} ==" in text
    metrics = ("tokens/s", "rollout-only share", "staleness histogram", "efficiency vs bound")
    for metric in (*metrics, "tight bound per step", "efficiency vs tight bound"):
        assert metric in text
    assert re.search(r"^dora/inflight throughput ratio: \d+\.\d\d$", text, re.MULTILINE)
    assert "version span per trajectory" in text
    doc = json.loads(out_json.read_text())
    assert set(doc["modes"]) == {"sync", "one_step_off", "partial", "dora", "inflight"}
    assert doc["setup"]["groups_per_step"] == 64
    assert doc["setup"]["gpus"] == 32  # 8 instances of 4 GPUs
    ratio = doc["modes"]["dora"]["tokens_per_s"] / doc["modes"]["sync"]["tokens_per_s"]
    assert lines[-1].endswith(f"{ratio:.2f}")
    for m in doc["modes"].values():
        assert m["max_staleness"] <= m["staleness_bound"]
        assert m["accounting"]["admitted"] == m["accounting"]["consumed"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ratio_is_na_without_sync(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--modes", "dora", "--steps", "2", "--instances", "4"]
    assert main([*argv, "groups_per_step=16"]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "dora/sync throughput ratio: n/a"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "paper-65"], "unknown preset 'paper-65'"),
        (["--modes", "sync,async"], "unknown mode 'async'"),
        (["decode_overhead_sm=3"], "did you mean decode_overhead_ms"),
        (["gpus=many"], "expected a int"),
        (["staleness=-1"], "staleness must be >= 0"),
        (["group_size=512"], "exceeds max_seqs"),
        (["--steps", "1"], "--steps must be >= 2"),
    ],
)
def test_bad_input_is_a_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *argv]) == 1
    assert message in capsys.readouterr().err


def test_terminal_output_uses_rich_tables() -> None:
    from dora.sim import plan, simulate, summarize
    from dora.sim.main import build_setup
    from dora.sim.report import render

    setup = build_setup("paper-64", ["groups_per_step=16"], steps=2, instances=4)
    m = summarize(simulate(setup, plan("partial", setup), seed=0))
    text = render([m], title="t", rich_ok=True)
    assert "version span per trajectory" in text and "\x1b[" in text
