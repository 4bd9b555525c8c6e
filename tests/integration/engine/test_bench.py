"""`dora bench engine` runs end to end on a small workload and ends with the ratio line."""

from __future__ import annotations

import re

import pytest

from dora.bench.engine import main

pytestmark = pytest.mark.timeout(120)


def test_bench_prints_table_and_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", "8", "--batch-size", "4", "--median-tokens", "4", "--max-tokens", "8"]
    assert main([*argv, "--no-vllm"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"engine/generate throughput ratio: \d+\.\d\d", lines[-1])
    assert any(line.startswith("engine (continuous)") for line in lines)
    assert any(line.startswith("engine, HF modules") for line in lines)
    assert any(
        re.fullmatch(r"fused/HF-modules decode throughput ratio: \d+\.\d\d", x) for x in lines
    )
