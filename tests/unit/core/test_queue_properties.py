"""Property tests of the transfer queue alone: a random driver (random completion orders, slow
trainers, slow weight loads, filters, failures with retries, trainer restarts) and the guarantees
C2 and C3 must keep whatever the order of events."""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from dora.core import Admitted, Assigned, Refused, TransferQueue


@dataclass
class Run:
    """A random run: the driver's view of what it admitted and what the trainer trained."""

    q: TransferQueue
    k: int
    b: int
    steps: int
    admitted: set[str] = field(default_factory=set)
    running: list[str] = field(default_factory=list)
    unstarted: list[str] = field(default_factory=list)
    filtered: set[str] = field(default_factory=set)
    rolled_back: set[str] = field(default_factory=set)
    inbox: dict[int, list[Assigned]] = field(default_factory=dict)
    trained: dict[int, list[Assigned]] = field(default_factory=dict)
    trainer_step: int = 0
    durable: int = -1
    pending_loads: list[int] = field(default_factory=list)
    restarts: int = 0

    def receive(self, assigned: list[Assigned] | tuple[Assigned, ...]) -> None:
        for a in assigned:
            assert 0 <= a.step - a.version <= self.k, a
            assert a.step >= self.trainer_step, a
            assert a.step < self.steps
            self.inbox.setdefault(a.step, []).append(a)
            assert len(self.inbox[a.step]) <= self.b


@st.composite
def run_params(draw: st.DrawFn) -> tuple[int, int, int, int, int, float, float, float, int]:
    b = draw(st.integers(1, 4))
    k = draw(st.integers(0, 4))
    steps = draw(st.integers(1, 8))
    slots = draw(st.integers(1, 8))
    retries = draw(st.integers(0, 2))
    p_filter = draw(st.sampled_from([0.0, 0.2]))
    p_fail = draw(st.sampled_from([0.0, 0.15]))
    p_restart = draw(st.sampled_from([0.0, 0.03]))
    seed = draw(st.integers(0, 2**32 - 1))
    return b, k, steps, slots, retries, p_filter, p_fail, p_restart, seed


def drive(params: tuple[int, int, int, int, int, float, float, float, int]) -> Run:
    b, k, steps, slots, retries, p_filter, p_fail, p_restart, seed = params
    rng = random.Random(seed)
    q = TransferQueue(groups_per_step=b, max_staleness=k, num_steps=steps, max_retries=retries)
    q.on_version_loaded(0)
    run = Run(q, k, b, steps)
    n = 0
    for _ in range(20_000):
        if run.trainer_step >= steps:
            break
        actions: list[str] = []
        if len(run.running) + len(run.unstarted) < slots and q.admission_blocker() is None:
            actions.append("admit")
        if run.unstarted:
            actions.append("start")
        if run.running:
            actions += ["complete"] * 3
        if len(run.inbox.get(run.trainer_step, [])) == b:
            actions.append("train")
        if run.pending_loads:
            actions.append("load")
        if run.durable < run.trainer_step - 1:
            actions.append("durable")
        assert actions, f"deadlock: t={q.step} {q.accounting()} {q.version_counts()}"
        action = rng.choice(actions)
        if action == "admit":
            n += 1
            gid = f"g{n}"
            out = q.try_admit(gid)
            assert isinstance(out, Admitted)
            assert out.version + k >= q.step
            run.admitted.add(gid)
            if rng.random() < 0.3:  # bound but not started yet
                run.unstarted.append(gid)
            else:
                q.start(gid)
                run.running.append(gid)
        elif action == "start":
            gid = run.unstarted.pop(rng.randrange(len(run.unstarted)))
            q.start(gid)
            run.running.append(gid)
        elif action == "complete":
            gid = run.running.pop(rng.randrange(len(run.running)))
            if rng.random() < p_fail:
                outcome = q.fail(gid)
                if outcome.retried:
                    q.start(gid)
                    run.running.append(gid)
                run.receive(outcome.assigned)
            elif rng.random() < p_filter:
                run.filtered.add(gid)
                run.receive(q.complete(gid, filtered=True))
            else:
                run.receive(q.complete(gid))
        elif action == "train":
            t = run.trainer_step
            batch = run.inbox.pop(t)
            if k == 0:
                assert all(a.version == t for a in batch)
            run.trained[t] = batch
            q.on_step_done(t)
            run.trainer_step += 1
            run.pending_loads.append(t + 1)
        elif action == "load":
            # Slow loads: the oldest pending version loads first, then maybe newer ones.
            q.on_version_loaded(run.pending_loads.pop(0))
        elif action == "durable":
            run.durable = run.trainer_step - 1
            q.on_durable(run.durable)
        if p_restart and run.trainer_step > 0 and rng.random() < p_restart:
            restart(run)
        q.check_invariant()
        if action in ("admit", "train", "load"):
            check_admissible(q)
        acc = q.accounting()
        assert acc.admitted == acc.consumed + acc.filtered + acc.rolled_back + acc.unassigned
    return run


def check_admissible(q: TransferQueue) -> None:
    """`admissible(v)` at the newest published version is the number of groups the gate admits
    one after another once an instance holds it (what a driver reports as its demand)."""
    v = q.published_version
    copy = pickle.loads(pickle.dumps(q))
    copy.on_version_loaded(v)
    n = 0
    while isinstance(copy.try_admit(f"probe{n}", version=v), Admitted):
        n += 1
    assert q.admissible(v) == n, (v, q.step, n)


def restart(run: Run) -> None:
    """The trainer crashes and restarts from its last durable checkpoint."""
    c = run.durable
    report = run.q.rollback(c)
    run.restarts += 1
    run.rolled_back |= set(report.rolled_back)
    run.running = [g for g in run.running if g not in run.rolled_back]
    run.unstarted = [g for g in run.unstarted if g not in run.rolled_back]
    run.trainer_step = c + 1
    run.inbox = {}
    run.trained = {s: v for s, v in run.trained.items() if s <= c}
    run.pending_loads = [w for w in run.pending_loads if w <= c + 1]
    run.receive(report.assigned)


@settings(max_examples=1000, deadline=None)
@given(run_params())
def test_every_group_consumed_once_within_staleness(
    params: tuple[int, int, int, int, int, float, float, float, int],
) -> None:
    run = drive(params)
    q = run.q
    assert run.trainer_step == run.steps, "the run did not finish"
    assert q.finished
    consumed = [a.group_id for s in range(run.steps) for a in run.trained[s]]
    assert len(consumed) == len(set(consumed)) == run.steps * run.b
    assert all(len(run.trained[s]) == run.b for s in range(run.steps))
    assert set(consumed) | run.filtered | run.rolled_back == run.admitted
    assert not (set(consumed) & run.filtered) and not (set(consumed) & run.rolled_back)
    acc = q.accounting()
    assert acc.unassigned == 0 and not run.running and not run.unstarted
    assert acc.filtered == len(run.filtered) and acc.rolled_back == len(run.rolled_back)
    assert acc.consumed == len(consumed) and acc.admitted == len(run.admitted)
    for s in range(run.steps):
        for a in run.trained[s]:
            assert 0 <= s - a.version <= run.k


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_k0_trains_b_groups_of_the_current_version(b: int, steps: int, seed: int) -> None:
    run = drive((b, 0, steps, 8, 0, 0.2, 0.0, 0.0, seed))
    for s in range(steps):
        assert [a.version for a in run.trained[s]] == [s] * b


def test_refusal_is_not_admission() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=0)
    assert isinstance(q.try_admit("a"), Refused)
    assert q.accounting().admitted == 0
