"""The CPU calibration (dora/bench/cpu_costs.py) and the cost model's CPU knobs: instances that
share cores, a trainer that does not scale linearly with threads."""

from __future__ import annotations

import dataclasses
import re
import statistics
from pathlib import Path

import pytest

from dora.bench.cpu_costs import (
    BENCH_COSTS,
    BENCH_SETTINGS,
    Costs,
    fit_decode,
    group_share,
    lognormal,
    one_core_serve,
    setup_for,
    write_lengths,
)
from dora.cli import main
from dora.config import load_config
from dora.costs import PRESETS, Setup, preset
from dora.costs.presets import CPU_BENCH_LENGTHS
from dora.sim import plan, simulate
from dora.sim.report import summarize
from dora.sim.workload import Workload, read_lengths
from tests.unit.sim.test_engine import check_run

COSTS = Costs(
    decode_t0_s=3e-3,
    decode_c_s=4e-5,
    decode_k_s=2e-8,
    prefill_s_per_token=1e-5,
    train_s_per_token=4e-4,
    train_step_s=0.05,
    train_speedup=1.3,
    weight_sync_s=0.02,
    prompt_median=60,
    prompt_sigma=0.3,
    prompt_max=200,
    response_median=20,
    response_sigma=1.0,
    group_share=0.8,
    response_mean=36,
    response_max=512,
    params=500_000,
    layers=2,
    hidden=128,
    kv_heads=4,
    head_dim=32,
    cores=2,
)


def test_fit_decode_recovers_the_coefficients() -> None:
    samples = [(b, s, 3e-3 + 4e-5 * b + 2e-8 * s) for b in (1, 4, 16, 64) for s in (100, 5000)]
    t0, c, k = fit_decode(samples)
    assert t0 == pytest.approx(3e-3) and c == pytest.approx(4e-5) and k == pytest.approx(2e-8)


def test_setup_for_reproduces_the_measured_costs() -> None:
    config = load_config("examples/math/bench.toml")
    s = setup_for(config, COSTS)
    assert s.decode_coefficients() == pytest.approx((3e-3, 4e-5, 2e-8), rel=1e-6)
    assert s.prefill_s(0, 60) == pytest.approx(60 * 1e-5)  # at the median prompt
    assert s.train_s(1000, 1) == pytest.approx(0.4)
    assert s.train_s(1000, 2) == pytest.approx(0.4 / 1.3)
    assert s.kv_capacity_tokens == pytest.approx(
        config.serve.max_running * config.model.max_model_len
    )
    assert (s.instances, s.colocated_instances) == (4, 4)  # 4 processes on 1 core, or on 2
    assert (s.gpus, s.rollout_gpus, s.gpus_per_instance) == (2, 1, 1)
    assert s.groups_per_step == config.rollout.batch_size
    assert s.response_max == config.rollout.max_tokens


COSTS_GROUP = 8


def _rollout_bound(**changes: object) -> Setup:
    base = dataclasses.replace(
        setup_for(load_config("examples/math/bench.toml"), COSTS),
        response_sigma=0.0,  # every sample decodes the same number of tokens
        group_share=0.0,
        prompt_sigma=0.0,
        train_gpu_s_per_token=1e-9,
        train_step_overhead_s=0.0,
        weight_sync_s=1e-6,
        max_seqs=COSTS_GROUP,  # one group per instance: all four decode at once
        steps=6,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_instances_sharing_one_core_decode_as_slowly_as_time_slicing_says() -> None:
    # one_step_off: 4 instances, one group each, on serve's one core
    alone = summarize(
        simulate(_rollout_bound(shared_cores=False), plan("one_step_off", _rollout_bound()))
    )
    shared_setup = _rollout_bound()
    run = simulate(shared_setup, plan("one_step_off", shared_setup))
    check_run(run, shared_setup)
    shared = summarize(run)
    assert shared["step_min"] / alone["step_min"] == pytest.approx(4.0, rel=0.1)
    # colocated sync: the same 4 instances on 2 cores
    sync = summarize(simulate(shared_setup, plan("sync", shared_setup)))
    assert shared["step_min"] / sync["step_min"] == pytest.approx(2.0, rel=0.1)


def test_gpu_presets_are_unchanged_by_the_cpu_knobs() -> None:
    for s in PRESETS.values():
        if s.name.startswith("paper"):
            assert (s.pool_instances, s.shared_cores, s.train_parallel_efficiency) == (0, False, 1)
            assert s.train_s(1000, 4) == pytest.approx(1000 * s.train_gpu_s_per_token / 4)


def test_the_cpu_bench_preset_is_the_benchmark_config() -> None:
    # the preset's settings must be those of examples/math/bench.toml, or its prediction is of
    # another workload
    bench = load_config("examples/math/bench.toml")
    stored = load_config(None, list(BENCH_SETTINGS))
    for section in ("model", "serve", "rollout", "learn"):
        for item in BENCH_SETTINGS:
            key, _, _ = item.partition("=")
            if key.startswith(f"{section}."):
                name = key.split(".", 1)[1]
                got = getattr(getattr(stored, section), name)
                assert getattr(getattr(bench, section), name) == got, key
    s = preset("cpu-bench")
    assert s == setup_for(bench, BENCH_COSTS, lengths_file=CPU_BENCH_LENGTHS)
    assert s.shared_cores and s.pool_instances == bench.serve.instances
    # the stored groups are of the benchmark's group size and max_tokens, and the stored costs'
    # length statistics are theirs
    groups = [[int(n) for n in g] for g in read_lengths(str(CPU_BENCH_LENGTHS))]
    assert {len(g) for g in groups} == {bench.rollout.group_size}
    assert max(n for g in groups for n in g) == bench.rollout.max_tokens
    every = [float(n) for g in groups for n in g]
    assert statistics.fmean(every) == pytest.approx(BENCH_COSTS.response_mean)
    assert lognormal(every) == pytest.approx(
        (BENCH_COSTS.response_median, BENCH_COSTS.response_sigma)
    )
    assert group_share(groups) == pytest.approx(BENCH_COSTS.group_share)


def test_measured_groups_are_drawn_whole(tmp_path: Path) -> None:
    groups = [(90, [5, 6, 7, 8, 9, 10, 11, 12]), (100, [300, 400, 500, 512, 200, 250, 260, 270])]
    path = write_lengths(tmp_path / "lengths.txt", groups)
    s = setup_for(load_config("examples/math/bench.toml"), COSTS, lengths_file=path)
    w = Workload(s, seed=0)
    drawn = {tuple(sorted(t for e in w.group() for t in e.turns)) for _ in range(40)}
    assert drawn == {tuple(sorted(g)) for _, g in groups}  # a hard prompt's answers stay together
    # a smaller group takes that many of one line's answers, none twice
    small = Workload(dataclasses.replace(s, group_size=4), seed=0)
    for _ in range(20):
        got = sorted(t for e in small.group() for t in e.turns)
        assert len(set(got)) == 4 and any(set(got) <= set(g) for _, g in groups)


def test_one_core_serve_replays_continuous_batching() -> None:
    costs = dataclasses.replace(COSTS, decode_k_s=0.0, prefill_s_per_token=0.0)
    # 4 sequences of 3 tokens, 2 rows: two rounds of 3 steps at b = 2
    two_rows = one_core_serve(costs, [(10, [3, 3, 3, 3])], max_running=2)
    assert two_rows == pytest.approx(6 * (3e-3 + 2 * 4e-5) / 12)
    # a long answer alone at the end costs a whole step per token: the tail is the expense
    tail = one_core_serve(costs, [(10, [1, 1, 1, 100])], max_running=64)
    assert tail == pytest.approx((3e-3 + 4 * 4e-5 + 99 * (3e-3 + 4e-5)) / 103)
    with_prefill = one_core_serve(COSTS, [(10, [3])], max_running=1)
    assert with_prefill == pytest.approx((10 * 1e-5 + 3 * 3e-3 + 3 * 4e-5 + 2e-8 * 33) / 3)


def test_simulate_the_cpu_bench_preset_in_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--preset", "cpu-bench", "--steps", "6"]) == 0
    text = capsys.readouterr().out
    assert "step time (s)" in text and "step time (min)" not in text
    assert re.search(r"dora/sync throughput ratio: \d+\.\d\d\n$", text)
