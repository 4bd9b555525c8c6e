"""Unit tests of the transfer queue: the worked examples of scheduling.md and each rule alone."""

from __future__ import annotations

import pickle

import pytest

from dora.core import (
    Admitted,
    Assigned,
    GroupState,
    RefusalReason,
    Refused,
    TransferQueue,
)
from dora.errors import SchedulingError


def admit(q: TransferQueue, gid: str, version: int | None = None) -> Admitted:
    out = q.try_admit(gid, version=version)
    assert isinstance(out, Admitted), out
    q.start(gid)
    return out


def publish(q: TransferQueue, step: int) -> None:
    q.on_step_done(step)
    q.on_version_loaded(step + 1)


def test_design_example_out_of_order_completion() -> None:
    """scheduling.md, worked example: the invariant refuses g4 at step 1, so g2 and g3 keep C3."""
    q = TransferQueue(groups_per_step=1, max_staleness=2)
    q.on_version_loaded(0)
    for gid in ("g1", "g2", "g3"):
        assert admit(q, gid).deadline == 2
    assert q.try_admit("extra") == Refused(RefusalReason.INVARIANT)
    assert q.complete("g1") == [Assigned("g1", 0, 0)]
    assert q.step == 1
    publish(q, 0)
    assert admit(q, "g4").deadline == 3
    assert q.complete("g4") == []  # step 1 taking g4 would leave 2 deadline-2 groups for 1 slot
    assert q.complete("g2") == [Assigned("g2", 1, 0)]  # g4 still blocked: g3 needs step 2
    assert q.complete("g3") == [Assigned("g3", 2, 0), Assigned("g4", 3, 1)]
    assert q.staleness_histogram() == [1, 1, 2]


def test_design_example_rule_a_slow_trainer() -> None:
    """scheduling.md, rule (a): queue at t = 3 with only version 0 loaded admits nothing."""
    q = TransferQueue(groups_per_step=1, max_staleness=2)
    q.on_version_loaded(0)
    for gid in ("g1", "g2", "g3"):
        admit(q, gid)
    steps = [a.step for gid in ("g1", "g2", "g3") for a in q.complete(gid)]
    assert steps == [0, 1, 2]
    assert q.step == 3
    # The invariant alone would allow it: U(<= 3) + 1 = 1 <= cap(3) = 1.
    assert q.try_admit("g4") == Refused(RefusalReason.WEIGHTS_NOT_LOADED)
    q.on_step_done(0)
    assert q.try_admit("g4") == Refused(RefusalReason.WEIGHTS_NOT_LOADED)  # published, not loaded
    q.on_version_loaded(1)
    assert q.try_admit("g4") == Admitted("g4", 1, 3)
    assert q.admission_waits()[RefusalReason.WEIGHTS_NOT_LOADED] == 2


def test_k0_is_synchronous() -> None:
    q = TransferQueue(groups_per_step=2, max_staleness=0)
    q.on_version_loaded(0)
    admit(q, "a")
    admit(q, "b")
    assert q.try_admit("c") == Refused(RefusalReason.INVARIANT)
    assert q.complete("b") == [Assigned("b", 0, 0)]
    assert q.complete("a") == [Assigned("a", 0, 0)]
    assert q.try_admit("c") == Refused(RefusalReason.WEIGHTS_NOT_LOADED)
    publish(q, 0)
    assert q.try_admit("c") == Admitted("c", 1, 1)


def test_admission_binds_newest() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=1)
    q.on_version_loaded(0)
    assert q.try_admit("a") == Admitted("a", 0, 1)
    assert q.try_admit("b") == Admitted("b", 0, 1)
    assert q.try_admit("c") == Refused(RefusalReason.INVARIANT)
    q.start("a")
    assert q.complete("a") == [Assigned("a", 0, 0)]
    publish(q, 0)
    assert q.try_admit("x", version=0) == Refused(RefusalReason.NOT_NEWEST)


def test_admit_old_versions_admits_old_version() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=2, admit_old_versions=True)
    q.on_version_loaded(0)
    admit(q, "a")
    assert q.complete("a") == [Assigned("a", 0, 0)]
    publish(q, 0)
    assert q.try_admit("old", version=0) == Admitted("old", 0, 2)


def test_filter_unlocks_assignment_and_counts() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=1)
    q.on_version_loaded(0)
    admit(q, "a")
    admit(q, "b")
    assert q.complete("b", filtered=True) == []
    assert q.state("b") is None
    assert q.complete("a") == [Assigned("a", 0, 0)]
    acc = q.accounting()
    assert (acc.admitted, acc.consumed, acc.filtered, acc.unassigned) == (2, 1, 1, 0)


def test_fail_retries_then_masks() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=0, max_retries=1)
    q.on_version_loaded(0)
    admit(q, "a")
    out = q.fail("a")
    assert out.retried and out.assigned == ()
    assert q.state("a") is GroupState.ADMITTED
    q.start("a")
    out = q.fail("a")
    assert not out.retried and out.assigned == (Assigned("a", 0, 0),)
    assert q.accounting().masked == 1


def test_durable_releases_assigned_groups() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=1)
    q.on_version_loaded(0)
    admit(q, "a")
    q.complete("a")
    assert q.state("a") is GroupState.ASSIGNED
    q.on_step_done(0)
    assert q.on_durable(0) == ["a"]
    assert q.state("a") is None


def test_horizon_caps_deadlines_and_stops_admission() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=3, num_steps=2)
    q.on_version_loaded(0)
    assert admit(q, "a").deadline == 1
    admit(q, "b")
    assert q.try_admit("c") == Refused(RefusalReason.INVARIANT)
    q.complete("a")
    q.complete("b")
    assert q.finished
    assert q.try_admit("c") == Refused(RefusalReason.HORIZON)
    assert q.accounting().unassigned == 0


def test_rollback_removes_ghosts_and_reoffers() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=2)
    q.on_version_loaded(0)
    for gid in ("a", "b"):
        admit(q, gid)
    q.complete("a")  # step 0
    publish(q, 0)  # version 1
    admit(q, "c")  # version 1, deadline 3
    q.complete("b")  # step 1
    publish(q, 1)  # version 2: a ghost after a restart from step 0
    admit(q, "d")
    q.on_durable(0)
    report = q.rollback(0)
    assert report.rolled_back == ("d",)
    assert report.ghost_versions == (2,)
    assert report.reoffered == ("b",)
    assert report.assigned == (Assigned("b", 1, 0),)
    assert report.incarnation == 1 and q.step == 2 and q.newest_version == 1
    # A message of the lost incarnation is ignored, a version newer than published is refused.
    assert not q.on_step_done(1, incarnation=0)
    with pytest.raises(SchedulingError):
        q.on_version_loaded(2)
    acc = q.accounting()
    assert acc.admitted == acc.consumed + acc.filtered + acc.rolled_back + acc.unassigned
    assert (acc.rolled_back, acc.reoffered, acc.ignored_messages) == (1, 1, 1)
    assert q.version_tag(1) == (0, 1)


def test_rollback_cannot_undo_durable_step() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=1)
    q.on_version_loaded(0)
    admit(q, "a")
    q.complete("a")
    q.on_step_done(0)
    q.on_durable(0)
    with pytest.raises(SchedulingError):
        q.rollback(-1)


def test_bad_calls_raise() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=1)
    q.on_version_loaded(0)
    admit(q, "a")
    with pytest.raises(SchedulingError):
        q.try_admit("a")
    with pytest.raises(SchedulingError):
        q.filter("a")
    with pytest.raises(SchedulingError):
        q.complete("nope")
    with pytest.raises(SchedulingError):
        q.on_step_done(3)
    with pytest.raises(SchedulingError):
        TransferQueue(groups_per_step=0, max_staleness=1)


def test_rollback_removes_tainted_partial_groups() -> None:
    """Partial mode: a group that began at a real version but resumed on a ghost goes too."""
    q = TransferQueue(groups_per_step=1, max_staleness=2)
    q.on_version_loaded(0)
    admit(q, "a")
    admit(q, "b")  # version 0; in partial mode it resumes on version 1 and 2
    q.complete("a")
    publish(q, 0)
    report = q.rollback(-1, tainted={"b"})
    assert report.rolled_back == ("b",) and report.reoffered == ("a",)
    assert report.assigned == (Assigned("a", 0, 0),)
    assert q.accounting().rolled_back == 1


def filled(steps: int) -> TransferQueue:
    """A queue whose steps `0 .. steps - 1` are filled by version 0 (none trained yet)."""
    q = TransferQueue(groups_per_step=1, max_staleness=steps)
    q.on_version_loaded(0)
    for s in range(steps):
        admit(q, f"g{s}/0")
        q.complete(f"g{s}/0")
    return q


def test_durable_for_a_step_never_filled_is_refused() -> None:
    q = filled(1)
    assert q.step == 1
    for step in (1, 10**7):  # step 1 is being filled; 10**7 would loop over the whole range
        with pytest.raises(SchedulingError, match=rf"step {step}.*filled"):
            q.on_durable(step)
    admit(q, "late")
    q.complete("late")  # assigned to step 1, which a wrong Durable(1) would have skipped
    q.on_step_done(0)
    assert q.on_durable(0) == ["g0/0"]
    q.on_step_done(1)
    assert q.on_durable(1) == ["late"]
    assert q.rollback(1).rolled_back == ()


def test_step_done_out_of_order_is_refused() -> None:
    q = filled(3)
    q.on_step_done(0)
    q.on_step_done(1)
    with pytest.raises(SchedulingError, match=r"step 3.*expected step 2"):
        q.on_step_done(3)  # never filled either
    q = filled(3)
    with pytest.raises(SchedulingError, match=r"step 1.*expected step 0"):
        q.on_step_done(1)


def test_rollback_to_a_step_never_trained_is_refused() -> None:
    q = filled(3)
    q.on_step_done(0)
    with pytest.raises(SchedulingError, match=r"step 1.*never trained"):
        q.rollback(1)  # filled, but the trainer reported only step 0
    assert q.rollback(0).step == 0


def run_steps(q: TransferQueue, first: int, last: int) -> None:
    """Fill, train, load and make durable steps `first`..`last` (one group a step, B = 1),
    reloading an old version now and then, as an instance serving a parked request does."""
    for step in range(first, last + 1):
        admit(q, f"g{step}")
        q.complete(f"g{step}")
        publish(q, step)
        if step % 7 == 0:
            q.on_version_loaded(step - 1)
        q.on_durable(step)


def test_state_stays_flat_with_the_length_of_a_run() -> None:
    # The loaded versions and each version's incarnation were kept for the whole run.
    q = TransferQueue(groups_per_step=1, max_staleness=2)
    q.on_version_loaded(0)
    run_steps(q, 0, 199)
    early = len(pickle.dumps(q))
    run_steps(q, 200, 3999)
    assert len(pickle.dumps(q)) < early * 1.05 + 200, (early, len(pickle.dumps(q)))


def test_pruned_state_answers_as_the_full_one() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=2)
    q.on_version_loaded(0)
    run_steps(q, 0, 49)
    q.rollback(49)  # incarnation 1: versions up to 50 stay incarnation 0's
    run_steps(q, 50, 99)
    assert [q.version_tag(w) for w in (0, 30, 50, 51, 100, 101)] == [
        (0, 0),
        (0, 30),
        (0, 50),
        (1, 51),
        (1, 100),
        (1, 101),
    ]
    # Admission, re-binding and roll-back need only recent versions: a version older than the
    # staleness bound is refused as before, and a roll-back finds the newest real version.
    assert q.admission_blocker(version=10) is RefusalReason.WEIGHTS_NOT_LOADED
    report = q.rollback(99)
    assert report.ghost_versions == () and q.newest_version == 100
    run_steps(q, 100, 120)
    assert q.version_tag(100) == (1, 100) and q.version_tag(101) == (2, 101)
