"""A small emulated cluster through the real dora serve and dora learn: 16 instances, all four
modes, a few steps each; C1-C3 and the accounting hold on every consumed group.

The four runs go side by side (their processes mostly wait on modelled time), so the test takes
about as long as one run.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dora.bench.cluster import CONFIG, emulated_placement, mode_overrides, overheads
from dora.bench.modes import run_mode
from dora.bench.modes_report import summarise
from dora.costs import apply_overrides, preset
from dora.emulated.checks import check_run
from dora.sim.modes import PAPER_MODES as MODES
from dora.sim.modes import plan as mode_plan

pytestmark = pytest.mark.timeout(240)

STEPS = 3
COST = [
    "pool_instances=16",
    "groups_per_step=32",
    "group_size=4",
    "max_seqs=32",
    "prompt_median=40",
    "prompt_max=120",
    "response_median=80",
    "response_max=800",
    "train_step_overhead_s=5",
]


def _run(name: str, out: Path) -> tuple[str, int]:
    setup = apply_overrides(preset("paper-64"), COST)
    plan = mode_plan(name, setup)
    settings = mode_overrides(
        setup, plan, preset_name="paper-64", cost=COST, steps=STEPS, scale=0.005
    )
    # serve's ticks measure its CPU and lag: often enough for a run of a few real seconds
    settings.append("log.metrics_every_s=0.2")
    cores = sorted(os.sched_getaffinity(0))
    placement = emulated_placement(name, cores)
    return name, run_mode(str(CONFIG), settings, out / name, placement, steps=STEPS)


@pytest.mark.slow
def test_four_modes_on_16_emulated_instances_keep_c1_c3(tmp_path: Path) -> None:
    with ThreadPoolExecutor(len(MODES)) as pool:
        codes = dict(pool.map(lambda m: _run(m, tmp_path), MODES))
    for name in MODES:
        run_dir = tmp_path / name
        log = (
            (run_dir / "serve.log").read_text()[-3000:] if (run_dir / "serve.log").exists() else ""
        )
        assert codes[name] == 0, f"{name}: {log}"
        cluster = json.loads((run_dir / "emulated-cluster.json").read_text())
        assert cluster["instances"] == 16
        assert cluster["generated_tokens"] > 0
        plan = mode_plan(name, apply_overrides(preset("paper-64"), COST))
        check = check_run(
            run_dir,
            steps=STEPS,
            batch_size=32,
            staleness=plan.staleness,
            spans_versions=name == "partial",
        )
        assert check.ok, (name, check.problems)
        assert check.groups_checked == STEPS * 32
        consumed = (run_dir / "consumed.jsonl").read_text().splitlines()
        assert len(consumed) == STEPS * 32  # every group reached the trainer exactly once
        # the overheads `dora bench cluster` prints: serve's and the cluster's CPU in cores
        # (each a busy process here: above zero, below the two cores they share)
        result = summarise(run_dir, name=name, placement="16 inst", warmup=0)
        over = overheads(result, scale=0.005, warmup=0, checked=(check.groups_checked, []))
        assert over.serve_self_cores is not None and 0.01 < over.serve_self_cores < 2.0
        assert over.cluster_cores is not None and 0.01 < over.cluster_cores < 2.0
        assert over.lag_ms_p99 >= over.lag_ms_median >= 0.0
        # every tick's stall is at least its own lag: the longest wait the probe saw includes it
        assert over.stall_ms_max >= over.stall_ms_p99 >= 0.0
        assert over.stall_ms_max >= over.lag_ms_p99
        # both processes hold torch and the run: hundreds of MB, nowhere near the machine's size
        assert 100 < over.serve_rss_mb < 8000 and 100 < over.cluster_rss_mb < 8000
