"""Property tests of the queue and the orchestrator driven together in every mode: C1, C2 and C3
hold, nothing deadlocks, and the run ends with nothing left over, whatever the durations, the
completion order, the trainer's and the loads' speed, failures and restarts, with single-version
instances or multi-version ones (versions as adapters)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dora.core.orchestrator import Mode

from .simdriver import Params, Sim


@st.composite
def params(draw: st.DrawFn, mode: Mode | None = None) -> Params:
    mode = mode or draw(st.sampled_from(list(Mode)))
    k = {Mode.SYNC: 0, Mode.ONE_STEP_OFF: 1}.get(mode, draw(st.integers(0, 4)))
    g = draw(st.integers(1, 3))
    return Params(
        mode=mode,
        b=draw(st.integers(1, 4)),
        g=g,
        k=k,
        steps=draw(st.integers(1, 10)),
        instances=draw(st.integers(1, 5)),
        capacity=g * draw(st.integers(1, 3)),
        train_time=draw(st.sampled_from([0.1, 1.0, 10.0])),
        load_time=draw(st.sampled_from([0.1, 1.0, 8.0])),
        alpha=draw(st.sampled_from([1.1, 1.5, 3.0])),
        p_filter=draw(st.sampled_from([0.0, 0.2])),
        p_fail=draw(st.sampled_from([0.0, 0.15])),
        retries=draw(st.integers(0, 2)),
        p_restart=draw(st.sampled_from([0.0, 0.1])),
        instance_failures=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**32 - 1)),
        checkpoint_every=draw(st.integers(1, 3)),
        multi_version=draw(st.booleans()),
    )


def finished(p: Params) -> Sim:
    sim = Sim(p)
    sim.run()
    return sim


@settings(max_examples=1500, deadline=None)
@given(params())
def test_every_admitted_group_is_consumed_once_within_k(p: Params) -> None:
    sim = finished(p)
    consumed = [a.group_id for s in range(p.steps) for a in sim.trained[s]]
    assert len(consumed) == len(set(consumed)) == p.steps * p.b
    assert set(consumed) | sim.filtered | sim.rolled_back == sim.admitted
    assert not set(consumed) & (sim.filtered | sim.rolled_back)
    for s in range(p.steps):
        for a in sim.trained[s]:
            # The version the queue charged is the version of the group's first token.
            assert a.version == sim.group_version[a.group_id]
            assert 0 <= s - a.version <= p.k
    acc = sim.q.accounting()
    assert sim.q.finished and acc.unassigned == 0
    assert (acc.filtered, acc.rolled_back) == (len(sim.filtered), len(sim.rolled_back))
    assert not sim.pending, "groups still running at the horizon"
    assert sim.o.live() == {}
    assert sim.max_versions <= p.k + 1


@settings(max_examples=300, deadline=None)
@given(params(Mode.SYNC))
def test_sync_trains_b_groups_of_the_current_version(p: Params) -> None:
    sim = finished(p)
    for s in range(p.steps):
        assert [a.version for a in sim.trained[s]] == [s] * p.b
    assert sim.max_versions == 1


@settings(max_examples=300, deadline=None)
@given(params(Mode.ONE_STEP_OFF))
def test_one_step_off_serves_one_version_at_a_time(p: Params) -> None:
    sim = finished(p)
    assert sim.max_versions == 1  # checked after every event: all instances switch together
    for s in range(p.steps):
        assert all(s - a.version <= 1 for a in sim.trained[s])


@settings(max_examples=300, deadline=None)
@given(params(Mode.PARTIAL))
def test_partial_trajectories_span_versions_but_deadline_counts_from_head(p: Params) -> None:
    sim = finished(p)
    for rid, seg in sim.segments.items():
        assert seg[0] == sim.group_version[sim.group_of[rid]]
        assert seg == sorted(seg)


@settings(max_examples=300, deadline=None)
@given(params(Mode.INFLIGHT))
def test_inflight_trajectories_span_versions_without_a_park_and_k_counts_from_the_first_token(
    p: Params,
) -> None:
    sim = finished(p)  # staleness by the group's version (its first token's) <= K, C2, C3
    for rid, seg in sim.segments.items():
        assert seg[0] == sim.group_version[sim.group_of[rid]]
        assert seg == sorted(seg)
