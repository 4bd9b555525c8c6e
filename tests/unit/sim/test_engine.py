"""The simulator keeps the core's promises at scale: C2 and C3 in every mode, sync is synchronous,
partial spans versions, and dora beats sync on the paper's setup."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.costs import Setup, preset
from dora.sim import MODES, Run, plan, simulate
from dora.sim.main import build_setup
from dora.sim.report import chain_bound_s, summarize


def small(**changes: object) -> Setup:
    """paper-64's cost model on a small pool and batch: seconds of wall time per mode."""
    base = dataclasses.replace(
        preset("paper-64"),
        gpus=16,
        rollout_gpus=8,
        groups_per_step=24,
        group_size=4,
        max_seqs=32,
        steps=8,
        warmup_steps=2,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def check_run(run: Run, setup: Setup) -> None:
    k = run.plan.staleness
    assert run.staleness, "nothing was consumed"
    assert all(0 <= x <= k for x in run.staleness)
    assert run.step_groups == [setup.groups_per_step] * setup.steps
    for t, versions in enumerate(run.step_versions):
        assert all(0 <= t - w <= k for w in versions), (t, versions)
    acc = run.accounting
    # every admitted group consumed exactly once: nothing left over, nothing filtered
    assert acc["admitted"] == acc["consumed"] == setup.steps * setup.groups_per_step
    assert acc["unassigned"] == 0 and acc["filtered"] == 0
    assert len(run.staleness) == acc["consumed"]
    assert run.step_end_s == sorted(run.step_end_s)
    # The chain bound (docs/simulator.md) as the inequality it is: no run ends its measured
    # window sooner than the earliest end the bound computes from the window's start.
    ends, w = run.step_end_s, setup.warmup_steps
    start = ends[w - 1] if w >= 1 else 0.0
    assert chain_bound_s(run) * (len(ends) - w) <= ends[-1] - start + 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_keeps_staleness_and_consumes_each_group_once(mode: str) -> None:
    setup = small()
    check_run(simulate(setup, plan(mode, setup), seed=1), setup)


@given(
    b=st.integers(1, 12),
    g=st.integers(1, 6),
    k=st.integers(0, 3),
    instances=st.integers(2, 6),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 10_000),
    turns=st.sampled_from([1.0, 3.0]),
)
@settings(max_examples=25, deadline=None)
def test_random_setups_keep_the_rules(
    b: int, g: int, k: int, instances: int, mode: str, seed: int, turns: float
) -> None:
    setup = small(
        gpus=4 * instances,
        rollout_gpus=4 * (instances // 2),
        groups_per_step=b,
        group_size=g,
        staleness=k,
        max_seqs=max(g, 8),
        steps=5,
        warmup_steps=1,
        response_median=300,
        response_max=4000,
        turns=turns,
        tool_latency_s=2.0 if turns > 1 else 0.0,
        tool_tokens=50 if turns > 1 else 0,
    )
    check_run(simulate(setup, plan(mode, setup), seed=seed), setup)


def test_sync_trains_each_step_on_its_own_version_with_no_overlap() -> None:
    setup = small()
    run = simulate(setup, plan("sync", setup), seed=2)
    assert run.step_versions == [{t: setup.groups_per_step} for t in range(setup.steps)]
    # colocated: generation and training never overlap, so the trainer runs once per step
    assert len(run.trainer) == setup.steps
    assert run.migrations == run.parks == 0


def test_k0_in_the_multi_version_machinery_is_synchronous_too() -> None:
    setup = small(staleness=0)
    run = simulate(setup, plan("dora", setup), seed=3)
    assert run.step_versions == [{t: setup.groups_per_step} for t in range(setup.steps)]


def test_partial_trajectories_span_versions() -> None:
    setup = small(steps=6)
    run = simulate(setup, plan("partial", setup), seed=4)
    assert max(run.spans) > 1
    assert run.parks > 0
    # C3 still holds, counted from each trajectory's first token
    assert max(run.staleness) <= setup.staleness


def test_inflight_loads_under_running_requests_without_parking_or_migrating() -> None:
    """Every instance takes each new version under its running requests: trajectories span
    versions, nothing is parked, moved or drained, and staleness by the first token stays <= K."""
    setup = small(steps=6)
    run = simulate(setup, plan("inflight", setup), seed=4)
    assert max(run.spans) > 1
    assert run.parks == 0 and run.migrations == 0
    assert max(run.staleness) <= setup.staleness
    assert versions_at_once(run) == 1  # one version served at a time, the newest


def versions_at_once(run: Run) -> int:
    segs = [(a, b, v) for _, a, b, v in run.segments if v >= 0]
    return max(len({v for a, b, v in segs if a <= t < b}) for t, _, _ in segs)


def test_dora_holds_several_versions_at_once_and_one_step_off_one() -> None:
    setup = small()
    dora = simulate(setup, plan("dora", setup), seed=5)
    assert versions_at_once(dora) >= 2
    per_step = summarize(dora)["versions_held_per_step"]
    assert len(per_step) == setup.steps and max(per_step) == versions_at_once(dora)
    assert max(per_step) <= setup.staleness + 1  # versions t-K .. t
    assert versions_at_once(simulate(setup, plan("one_step_off", setup), seed=5)) == 1


def test_same_seed_same_numbers() -> None:
    setup = small(steps=4, warmup_steps=1)
    a = simulate(setup, plan("dora", setup), seed=7)
    b = simulate(setup, plan("dora", setup), seed=7)
    assert a.step_end_s == b.step_end_s and a.staleness == b.staleness


def test_paper_64_dora_beats_sync_in_a_few_steps() -> None:
    setup = build_setup("paper-64", [], steps=5)
    sync = summarize(simulate(setup, plan("sync", setup), seed=0))
    dora = summarize(simulate(setup, plan("dora", setup), seed=0))
    assert dora["tokens_per_s"] / sync["tokens_per_s"] > 1.0
    assert 0 < sync["efficiency"] <= 1.05 and 0 < dora["efficiency"] <= 1.05


def test_agentic_preset_runs_at_scale_of_controllers() -> None:
    setup = build_setup("agentic", ["groups_per_step=64", "controller_instances=16"], steps=3)
    setup = dataclasses.replace(setup, gpus=4 * 64, rollout_gpus=4 * 32)
    for mode in ("sync", "dora"):
        run = simulate(setup, plan(mode, setup), seed=0)
        check_run(run, setup)
    assert run.plan.instances == 32  # two controllers of 16


def test_migrations_carry_the_kv_cache_unless_told_not_to() -> None:
    setup = small(steps=6)
    with_kv = simulate(setup, plan("dora", setup), seed=6)
    assert with_kv.migrations > 0 and with_kv.migrated_gb > 0
    without = simulate(dataclasses.replace(setup, migrate_kv=False), plan("dora", setup), seed=6)
    assert without.migrated_gb == 0


def test_an_over_provisioned_pool_never_consolidates() -> None:
    # 16 instances of 256 slots for 24 groups of 4 per step: the newest version always has idle
    # instances, so migrating an old version's requests would only crowd its long tails.
    busy = small(steps=6)
    idle = small(steps=6, rollout_gpus=64, gpus=72, max_seqs=256)
    assert simulate(busy, plan("dora", busy), seed=6).migrations > 0
    run = simulate(idle, plan("dora", idle), seed=6)
    check_run(run, idle)
    assert run.migrations == 0


def test_the_tight_bound_is_the_chain_of_turns_where_tools_are_slow() -> None:
    """Hour-long tool waits make every episode's chain, not the GPUs' capacity, what bounds a
    step; the physical bound does not see them."""
    setup = small(turns=3.0, tool_latency_s=3600.0, tool_tokens=50, steps=5, warmup_steps=1)
    m = summarize(simulate(setup, plan("dora", setup), seed=3))
    assert m["chain_bound_min"] > 10 * m["bound_min"]
    assert m["tight_bound_min"] == m["chain_bound_min"]
    assert m["tight_efficiency"] <= 1.0 + 1e-9


@pytest.mark.parametrize(("mode", "k"), [("sync", 0), ("dora", 0), ("dora", 2)])
def test_the_chain_bound_is_tight_when_one_chain_is_the_whole_step(mode: str, k: int) -> None:
    """One episode a step, and an instance for each version in flight: every step waits for its
    version's weights, then its one chain, then the trainer's overhead, and nothing else. The
    chain bound must count the weight load a new version needs and must hold for the measured
    window itself, so it comes within prefill of the step time."""
    setup = small(
        gpus=16,
        rollout_gpus=12,
        groups_per_step=1,
        group_size=1,
        staleness=k,
        steps=8,
        warmup_steps=2,
        weight_sync_s=60.0,
        train_step_overhead_s=1.0,
        train_gpu_s_per_token=1e-6,
    )
    run = simulate(setup, plan(mode, setup), seed=2)
    check_run(run, setup)
    m = summarize(run)
    assert m["tight_bound_min"] == m["chain_bound_min"]
    assert 0.98 <= m["tight_efficiency"] <= 1.0 + 1e-9
    # what it waits for: the last step's chain, back to a step before the window
    path = m["chain_bound_path"].split(" <- ")
    assert path[0] == f"chain {setup.steps - 1}"
    assert path[-1] in ("time 0", *(f"end of step {j}" for j in range(setup.warmup_steps)))


def test_a_new_version_frees_the_instances_its_groups_need_at_once() -> None:
    """The gate's whole step of work for a new version waits for instances the old versions fill
    (their episodes hold slots while tools run): the driver reports all of it as demand, so the
    orchestrator frees as many instances as it needs in one plan and they load side by side.
    Every step's longest-chain group starts one weight load after its version is published."""
    setup = small(
        gpus=48,
        rollout_gpus=32,  # 8 instances of 8 slots: (K + 1) * B * G = 64 fills them all
        groups_per_step=4,
        group_size=4,
        max_seqs=8,
        steps=10,
        warmup_steps=4,
        turns=3.0,
        tool_latency_s=60.0,
        tool_tokens=50,
        response_median=300,
        response_max=4000,
        train_step_overhead_s=5.0,  # steps far shorter than chains, as on agentic work
    )
    run = simulate(setup, plan("dora", setup), seed=0)
    check_run(run, setup)
    lags = [
        admitted - run.step_end_s[version - 1]
        for version, admitted, _ in run.step_chain_group[setup.warmup_steps :]
    ]
    assert lags == pytest.approx([setup.weight_sync_s] * len(lags))


def test_the_report_names_what_the_chain_bound_waits_for() -> None:
    """sync waits for every step's longest chain in turn; dora on the small paper setup waits
    only for its trainer, step after step, from the window's start."""
    setup = small()
    sync = summarize(simulate(setup, plan("sync", setup), seed=1))["chain_bound_path"]
    assert sync == " <- ".join([*(f"chain {i}" for i in range(7, 1, -1)), "end of step 1"])
    dora = summarize(simulate(setup, plan("dora", setup), seed=1))["chain_bound_path"]
    assert dora == "train 7..2 <- end of step 1"
