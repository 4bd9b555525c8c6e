"""The cost model's derived numbers and the workload's shape match their stated sources."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from dora.costs import PRESETS, Setup, apply_overrides, preset
from dora.errors import ConfigError
from dora.sim.workload import Episode, Workload, mean_stats


def test_qwen_32b_on_tp4_h800() -> None:
    s = preset("paper-64")
    assert s.kv_bytes_per_token == 262_144  # 2 x 64 layers x 8 KV heads x 128 x bf16
    assert 700_000 < s.kv_capacity_tokens < 900_000
    t0, _, k = s.decode_coefficients()
    assert 0.015 < t0 < 0.03  # weight read (7 ms) + calibrated overhead
    assert k * 256 * 3000 < 0.05  # a full KV cache costs tens of ms per step
    assert s.instances == 8 and s.colocated_instances == 16 and s.train_gpus == 32
    assert PRESETS["paper-128"].instances == 16


def test_training_calibration_reproduces_the_sync_training_times() -> None:
    # the paper's sync: 22.91 min x 35% at 64 GPUs, 20.23 min x 27% at 128, 19.4M tokens a step
    s = preset("paper-64")
    tokens = 14_143 * 22.91 * 60
    for gpus, minutes in ((64, 22.91 * 0.35), (128, 20.23 * 0.27)):
        train = s.train_s(tokens, gpus) + s.train_step_overhead_s + s.weight_sync_s
        assert train / 60 == pytest.approx(minutes, rel=0.03)


def test_dapo_math_lengths() -> None:
    s = preset("paper-64")
    tokens, _, _ = mean_stats(s)
    assert 2200 < tokens < 2600  # the paper: mean about 2.4K tokens
    w = Workload(s, seed=0)
    lengths = np.array([t for _ in range(300) for e in w.group() for t in e.turns])
    assert lengths.max() == s.response_max
    assert np.percentile(lengths, 99) / np.median(lengths) > 10  # the paper's p99 / median


def test_group_samples_share_their_difficulty() -> None:
    s = preset("paper-64")
    w = Workload(s, seed=1)
    groups = [[math.log(e.turns[0]) for e in w.group()] for _ in range(400)]
    means = np.array([np.mean(g) for g in groups])
    within = np.mean([np.var(g) for g in groups])
    # between-group variance of the mean is about share * sigma^2
    assert means.var() > 0.3 * s.response_sigma**2 * s.group_share
    assert within < s.response_sigma**2


def _groups(s: Setup, n: int) -> list[list[Episode]]:
    w = Workload(s, seed=0)
    return [w.group() for _ in range(n)]


def test_lengths_file_and_agentic_context_limit(tmp_path: Path) -> None:
    f = tmp_path / "lengths.txt"
    f.write_text("# real lengths\n100\n200\n\n300\n")
    s = apply_overrides(preset("paper-64"), [f"lengths_file={f}"])
    lengths = {t for e in Workload(s, seed=0).group() for t in e.turns}
    assert lengths <= {100, 200, 300}
    bad = tmp_path / "bad.txt"
    bad.write_text("100\nlots\n")
    with pytest.raises(ConfigError, match="line 2"):
        Workload(dataclasses.replace(s, lengths_file=str(bad)), seed=0)
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("100\n100 200\n")
    with pytest.raises(ConfigError, match="mixes"):
        Workload(dataclasses.replace(s, lengths_file=str(mixed)), seed=0)
    empty = tmp_path / "empty-line.txt"
    empty.write_text("100 200\n , \n")
    with pytest.raises(ConfigError, match="line 2: not a number"):
        Workload(dataclasses.replace(s, lengths_file=str(empty)), seed=0)
    # group lines: commas and comments allowed, each group drawn whole
    groups = tmp_path / "groups.txt"
    groups.write_text("# measured\n" + "5, 6, 7, 8 # easy\n" * 2 + "400 " * s.group_size + "\n")
    g = dataclasses.replace(s, lengths_file=str(groups), group_size=4)
    seen = {tuple(sorted(t for e in w_group for t in e.turns)) for w_group in _groups(g, 30)}
    assert seen == {(5, 6, 7, 8), (400, 400, 400, 400)}
    a = dataclasses.replace(preset("agentic"), context_max=4000)
    for e in Workload(a, seed=0).group():
        assert len(e.tool_s) == len(e.turns) - 1
        assert e.prompt + sum(e.turns[:-1]) + a.tool_tokens * (len(e.turns) - 1) < 4000


def test_overrides_are_typed() -> None:
    s = apply_overrides(preset("paper-64"), ["migrate_kv=off", "weight_sync_s=2.5", "steps=9"])
    assert s.migrate_kv is False and s.weight_sync_s == 2.5 and s.steps == 9
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(s, ["steps"])
    with pytest.raises(ConfigError, match="do not fit"):
        apply_overrides(s, ["gpus_per_instance=1", "gpu_mem_gb=40"])
