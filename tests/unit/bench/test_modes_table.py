"""The modes benchmark: placements, the numbers read from run directories, the table, the ratios."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path

import pytest

from dora.bench.cluster import call_cpu_us, predicted, warmup_steps
from dora.bench.modes import plan
from dora.bench.modes_report import (
    ModeResult,
    bound_lines,
    machine_bound,
    median_run,
    plot_modes,
    profile_table,
    ratio_lines,
    summarise,
    table,
)
from dora.costs import preset
from dora.sim.modes import MODES
from dora.sim.modes import plan as mode_plan
from tests.unit.bench.fixtures import _tick, write_run


def test_every_mode_gets_every_core_by_default() -> None:
    placements = plan(
        ["sync", "one_step_off", "partial", "dora", "sync_split"],
        [0, 1],
        instances=4,
        trainer_cores=1,
    )
    sync, *shared, sync_split = placements
    assert sync.kind == "colocated" and sync.serve_cores == sync.trainer_cores == [0, 1]
    assert sync.trainer_threads == 2 and sync.instance_threads == 1
    for p in shared:
        assert p.kind == "shared" and not p.pinned
        assert p.serve_cores == p.trainer_cores == [0, 1]
        assert p.trainer_threads == 1 and p.instance_threads == 1
        assert p.describe().startswith("shared 0,1") and "colocated" not in p.describe()
    assert sync_split.kind == "split" and sync_split.mode == "sync"
    assert "colocated" in sync.describe()


def test_the_fixed_split_is_an_option_reported_as_such() -> None:
    placements = plan(["sync", "dora"], [0, 1], instances=4, trainer_cores=1, placement="split")
    sync, dora = placements
    assert sync.kind == "colocated"  # the synchronous baseline always has every core per phase
    assert dora.pinned and dora.serve_cores == [0] and dora.trainer_cores == [1]
    assert dora.trainer_threads == 1 and dora.instance_threads == 1
    assert dora.describe() == "split: serve 0 | learn 1"


def test_shared_threads_on_a_bigger_machine_leave_the_trainer_its_cores() -> None:
    [dora] = plan(["dora"], list(range(16)), instances=4, trainer_cores=4)
    assert dora.instance_threads == 3 and dora.trainer_threads == 4
    [dora] = plan(["dora"], [0, 1], instances=4, trainer_cores=1, trainer_threads=2)
    assert dora.trainer_threads == 2


def test_bigger_machines_split_the_cores_and_thread_the_instances() -> None:
    [dora] = plan(["dora"], list(range(16)), instances=4, trainer_cores=4, placement="split")
    assert dora.serve_cores == list(range(12)) and dora.trainer_cores == [12, 13, 14, 15]
    assert dora.instance_threads == 3 and dora.trainer_threads == 4


@pytest.mark.parametrize(
    ("modes", "cores", "trainer_cores"),
    [(["dora"], [0], 1), (["dora"], [0, 1], 2), (["fast"], [0, 1], 1)],
)
def test_impossible_plans_are_refused(
    modes: list[str], cores: list[int], trainer_cores: int
) -> None:
    with pytest.raises(ValueError):
        plan(modes, cores, instances=4, trainer_cores=trainer_cores, placement="split")
    with pytest.raises(ValueError, match="placement"):
        plan(["dora"], [0, 1], instances=4, trainer_cores=1, placement="colocated")


def test_numbers_come_from_the_steady_window(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "dora",
        mode="dora",
        steps=5,
        step_s=2.0,
        tokens=400.0,
        wait_s=0.5,
        train_s=1.0,
        staleness=2,
        util=0.8,
        instances=4,
        inflight=(6, 0, 1, 2),
    )
    (run / "bench-cpu.json").write_text(
        json.dumps(
            {
                "window_cpu_s": 16.0,
                "serve_cpu_s": 8.0,
                "serve_self_cpu_s": 2.0,
                "learn_cpu_s": 8.0,
                "load_avg": 3.0,
            }
        )
    )
    r = summarise(run, name="dora", placement="serve 0 | learn 1")
    # steps 1..4 trained between t=1 and t=9: 1600 tokens in 8 s
    assert r.tokens == 1600.0 and r.window_s == pytest.approx(8.0)
    assert r.tokens_per_s == pytest.approx(200.0)
    assert r.step_s == pytest.approx(2.0)
    assert r.cpu_s_per_token == pytest.approx(0.01)
    assert r.rollout_only_share == pytest.approx(0.25)
    assert r.trainer_idle_share == pytest.approx(0.5)
    assert r.instance_util == pytest.approx(0.8)
    assert r.staleness_max == 2 and 0 < r.staleness_mean < 2
    assert r.load_avg == 3.0 and r.max_versions_serving == 3
    assert r.serve_cores_used == r.learn_cores_used == pytest.approx(1.0)
    assert "1.00/1.00" in table([r])
    # where the time goes: 8 CPU-s per side over 1600 tokens; the trainer computes half the window
    assert r.serve_cpu_s_per_token == r.learn_cpu_s_per_token == pytest.approx(0.005)
    # three of four instances busy at every tick, with 6, 1 and 2 calls: the median is 2 (the mean
    # would be 3)
    assert r.busy_instances == pytest.approx(3.0) and r.calls_per_busy_instance == pytest.approx(2)
    row = profile_table([r]).splitlines()[-1].split()
    assert row == ["dora", "5.000", "1.250", "5.000", "3.00", "2.0", "50%", "25%", "1.00/1.00"]


def test_a_warm_up_moves_the_window_to_the_end_of_its_last_step(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "dora",
        mode="dora",
        steps=5,
        step_s=2.0,
        tokens=400.0,
        wait_s=0.5,
        train_s=1.0,
        staleness=2,
    )
    r = summarise(run, name="dora", placement="shared", warmup=2)
    # steps 3 and 4 trained after step 2 ended at t=5: 800 tokens in 4 s
    assert r.tokens == 800.0 and r.window_s == pytest.approx(4.0)
    assert r.steps == 3 and r.step_s == pytest.approx(2.0)
    with pytest.raises(ValueError, match="warm-up"):
        summarise(run, name="dora", placement="shared", warmup=4)


def test_the_cluster_bench_measures_each_mode_after_its_first_k_steps() -> None:
    setup = preset("paper-128")
    for mode in MODES:
        k = mode_plan(mode, setup).staleness
        assert warmup_steps(mode_plan(mode, setup)) == k
        run = predicted(setup, mode_plan(mode, setup), steps=3)
        assert len(run.step_end_s) == k + 3  # the warm-up is run, then the measured steps
    dora = predicted(setup, mode_plan("dora", setup), steps=3)
    # dora's step K drains the start (the version-0 tail): the longest of its run
    gaps = [b - a for a, b in itertools.pairwise(dora.step_end_s)]
    assert max(gaps) == gaps[2]


def _modes(tmp_path: Path, step_s: dict[str, float]) -> list[ModeResult]:
    """One 4-step run per mode, 300 tokens a step, at the given step times."""
    return [
        summarise(
            write_run(
                tmp_path / name,
                mode=name,
                steps=4,
                step_s=seconds,
                tokens=300.0,
                wait_s=1.0,
                train_s=1.0,
            ),
            name=name,
            placement="x",
        )
        for name, seconds in step_s.items()
    ]


def test_table_and_ratio_lines_end_with_dora_over_sync(tmp_path: Path) -> None:
    steps = {"sync": 4.0, "one_step_off": 2.5, "partial": 2.2, "dora": 2.0}
    results = _modes(tmp_path, steps)
    text = table(results)
    assert text.splitlines()[0].split()[:3] == ["mode", "cores", "tokens/s"]
    assert len(text.splitlines()) == 2 + 4
    lines = ratio_lines(results)
    assert lines == [
        "dora/one_step_off throughput ratio: 1.25",
        "dora/partial throughput ratio: 1.10",
        "dora/sync throughput ratio: 2.00",
    ]
    assert re.fullmatch(r"dora/sync throughput ratio: \d+\.\d\d", lines[-1])
    assert ratio_lines(results[:3]) == []  # no dora run, no ratio


def test_the_bound_is_every_core_at_the_cheapest_measured_token(tmp_path: Path) -> None:
    results = _modes(tmp_path, {"sync": 4.0, "dora": 2.0})  # 75 and 150 tokens/s
    assert machine_bound(results, 2) is None  # no CPU measured, no bound
    assert "not measured" in bound_lines(results, None)[0]  # said, not left out
    sync = dataclasses.replace(results[0], cpu_s_per_token=0.004)
    dora = dataclasses.replace(results[1], cpu_s_per_token=0.008)
    cheaper_repeat = dataclasses.replace(sync, cpu_s_per_token=0.0025)
    bound = machine_bound([sync, dora, cheaper_repeat], 2)
    assert bound is not None and bound[0] == pytest.approx(800.0) and bound[1] is cheaper_repeat
    lines = bound_lines([sync, dora], bound)
    assert lines[0].startswith("machine bound: 800 trained tokens/s")
    assert "0.0025" not in lines[0] and "2.500 CPU-ms" in lines[0]
    assert lines[1:] == [
        "  sync: 75 tokens/s, 9% of the bound",
        "  dora: 150 tokens/s, 19% of the bound",
    ]


def test_a_run_with_one_trained_step_is_refused(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "r", mode="dora", steps=1, step_s=1.0, tokens=1.0, wait_s=0.0, train_s=1.0
    )
    with pytest.raises(ValueError, match="fewer than 2"):
        summarise(run, name="dora", placement="x")


def test_the_median_run_stands_for_its_mode(tmp_path: Path) -> None:
    runs = [
        summarise(
            write_run(
                tmp_path / f"r{i}",
                mode="dora",
                steps=3,
                step_s=step_s,
                tokens=100.0,
                wait_s=0.1,
                train_s=0.5,
            ),
            name="dora",
            placement="x",
        )
        for i, step_s in enumerate((1.0, 4.0, 2.0))
    ]
    assert median_run(runs) is runs[2]
    assert median_run(runs[:2]) is runs[1]  # even count: the lower middle one


def test_the_modes_are_drawn_side_by_side(tmp_path: Path) -> None:
    results = _modes(tmp_path, {"sync": 3.0, "dora": 2.0})
    assert results[0].run_dir == str(tmp_path / "sync")
    path = plot_modes(results, tmp_path / "modes.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(path) as image:  # two stacked panels: one run's timeline is 12 x 3 inches
        width, height = image.size
    assert height / width > 0.3


def test_the_cpu_per_model_call_counts_the_runners_processes() -> None:
    first, last = _tick(0.0, []), _tick(10.0, [])
    first.cpu_s, last.cpu_s = 1.0, 3.0  # serve: 2 s over 1,000 calls
    first.runner_cpu_s, last.runner_cpu_s = 0.5, 4.5  # the runners: 4 s
    parts = call_cpu_us([first, last], 1000, {"request": 0.5})
    assert parts == pytest.approx({"total": 6000, "request": 500, "rest": 1500, "runners": 4000})
    first.runner_cpu_s = last.runner_cpu_s = 0.0  # no runners: no part of theirs
    assert call_cpu_us([first, last], 1000, {}) == pytest.approx({"total": 2000, "rest": 2000})
