"""A small discrete-event driver of the transfer queue and the orchestrator, for property tests.

Simulated instances run requests at rate 1 (heavy-tailed work per request), a simulated trainer
trains a step once it holds `B` groups, weight loads take time, instances die and come back,
groups fail, are filtered, and the trainer restarts from its last durable step. Every check that
must hold after *every* event is in `Sim.check`; the end-of-run checks are in the tests.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from dora.core import Admitted, Assigned, RefusalReason, TransferQueue, rollback
from dora.core.orchestrator import (
    Action,
    Drain,
    Load,
    Migrate,
    Mode,
    Orchestrator,
    Park,
    Resume,
    Undrain,
    Unload,
)


@dataclass(frozen=True)
class Params:
    mode: Mode
    b: int
    g: int
    k: int
    steps: int
    instances: int
    capacity: int
    train_time: float
    load_time: float
    alpha: float
    p_filter: float
    p_fail: float
    retries: int
    p_restart: float
    instance_failures: int
    seed: int
    checkpoint_every: int = 1
    multi_version: bool = False  # instances hold versions as adapters (modes dora and sync)


@dataclass
class Sim:
    p: Params
    q: TransferQueue = field(init=False)
    o: Orchestrator = field(init=False)
    rng: random.Random = field(init=False)
    now: float = 0.0
    events: list[tuple[float, int, tuple[str, ...]]] = field(default_factory=list)
    seq: int = 0
    tok: dict[str, int] = field(default_factory=dict)  # request -> event token
    loads: dict[int, Load] = field(default_factory=dict)  # loads in progress, by id
    end: dict[str, float] = field(default_factory=dict)  # running request -> finish time
    left: dict[str, float] = field(default_factory=dict)  # parked request -> work left
    segments: dict[str, list[int]] = field(default_factory=dict)  # request -> versions used
    group_of: dict[str, str] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)  # group -> requests still running
    group_version: dict[str, int] = field(default_factory=dict)
    admitted: set[str] = field(default_factory=set)
    filtered: set[str] = field(default_factory=set)
    rolled_back: set[str] = field(default_factory=set)
    inbox: dict[int, list[Assigned]] = field(default_factory=dict)
    trained: dict[int, list[Assigned]] = field(default_factory=dict)
    trainer_step: int = 0
    trainer_busy: bool = False
    incarnation: int = 0
    durable: int = -1
    n_groups: int = 0
    n_instances: int = 0
    failures_left: int = 0
    max_versions: int = 0
    steps_done_events: int = 0
    draining: set[str] = field(default_factory=set)  # mirrored from Drain / Undrain / Load only

    def __post_init__(self) -> None:
        p = self.p
        self.rng = random.Random(p.seed)
        self.q = TransferQueue(
            groups_per_step=p.b, max_staleness=p.k, num_steps=p.steps, max_retries=p.retries
        )
        self.o = Orchestrator(mode=p.mode)
        self.failures_left = p.instance_failures
        for _ in range(p.instances):
            self.add_instance()
        if self.failures_left:
            self.at(self.rng.uniform(0, 5 * p.train_time), "kill")

    # --- plumbing ------------------------------------------------------------------------------

    def at(self, when: float, *event: str) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, event))

    def add_instance(self) -> None:
        self.n_instances += 1
        self.apply(
            self.o.add_instance(
                f"i{self.n_instances}", capacity=self.p.capacity, multi_version=self.p.multi_version
            )
        )

    def apply(self, actions: list[Action]) -> None:
        views = {v.id: v for v in self.o.instances()}
        for a in actions:
            if isinstance(a, Load):
                self.draining.discard(a.instance)
                for rid in self.end:  # inflight: the load goes under the instance's requests
                    if self.o.location(rid) == a.instance and self.p.mode is Mode.INFLIGHT:
                        self.segments[rid].append(a.version)
                slow = 5.0 if self.rng.random() < 0.2 else 1.0
                delay = self.p.load_time * slow * self.rng.uniform(0.5, 1.5)
                self.loads[a.id] = a
                self.at(self.now + delay, "loaded", str(a.id))
            elif isinstance(a, Migrate):
                self.version_of(views, a.dst)  # ready
                version = self.o.request_version(a.request)
                assert version in self.o.held_versions(a.dst), (a, views[a.dst])  # C1
                self.segments[a.request].append(version)
            elif isinstance(a, Park):
                self.left[a.request] = self.end.pop(a.request) - self.now
                self.tok[a.request] += 1
            elif isinstance(a, Resume):
                assert a.version in self.o.held_versions(a.instance), a  # C1
                self.segments[a.request].append(a.version)
                self.run_request(a.request, self.left.pop(a.request))
            elif isinstance(a, Unload):
                assert self.p.multi_version and a.version not in self.o.live(), a
            elif isinstance(a, Undrain):
                assert a.instance in self.draining
                self.draining.remove(a.instance)
            else:
                assert isinstance(a, Drain)
                self.draining.add(a.instance)

    @staticmethod
    def version_of(views: dict[str, object], instance: str) -> int:
        v = views[instance]
        version = getattr(v, "version", None)
        assert version is not None and getattr(v, "ready", False), v
        return int(version)

    def run_request(self, rid: str, work: float) -> None:
        t = self.tok[rid] = self.tok.get(rid, 0) + 1
        self.end[rid] = self.now + work
        self.at(self.now + work, "done", rid, str(t))

    def work(self) -> float:
        return min(self.rng.paretovariate(self.p.alpha), 50.0)

    # --- the driver ----------------------------------------------------------------------------

    def pump(self) -> None:
        """Admit groups at the newest published version, while the queue allows it and an
        instance holding that version has room (docs/scheduling.md, "Admission"). With an odd
        seed the driver also reports its backlog (`set_demand`: the samples of every group the queue
        would admit)."""
        w = self.o.newest
        while (blocker := self.q.admission_blocker(version=w)) is None:
            self.n_groups += 1
            gid = f"g{self.n_groups}"
            rids = [f"{gid}/{j}" for j in range(self.p.g)]
            if self.o.place(rids, version=w) is None:
                self.q.record_admission_wait(RefusalReason.NO_CAPACITY)
                self.report_demand(self.p.g * self.q.admissible(w))
                return
            out = self.q.try_admit(gid, version=w)
            assert isinstance(out, Admitted) and out.version == w
            assert w + self.p.k >= self.q.step
            self.q.start(gid)
            self.admitted.add(gid)
            self.group_version[gid] = w
            self.start_requests(gid, rids, w)
        waiting = blocker is RefusalReason.WEIGHTS_NOT_LOADED
        self.report_demand(self.p.g * self.q.admissible(w) if waiting else 0)

    def report_demand(self, requests: int) -> None:
        if self.p.seed % 2 and self.o.demand != requests:
            self.apply(self.o.set_demand(requests))

    def start_requests(self, gid: str, rids: list[str], w: int) -> None:
        self.pending[gid] = len(rids)
        for rid in rids:
            self.group_of[rid] = gid
            self.segments[rid] = [w]
            self.run_request(rid, self.work())

    def receive(self, assigned: list[Assigned] | tuple[Assigned, ...]) -> None:
        for a in assigned:
            assert 0 <= a.step - a.version <= self.p.k, a
            assert a.step >= self.trainer_step and a.step < self.p.steps, a
            box = self.inbox.setdefault(a.step, [])
            box.append(a)
            assert len(box) <= self.p.b
        self.maybe_train()

    def maybe_train(self) -> None:
        t = self.trainer_step
        if not self.trainer_busy and t < self.p.steps and len(self.inbox.get(t, [])) == self.p.b:
            self.trainer_busy = True
            delay = self.p.train_time * self.rng.uniform(0.5, 1.5)
            self.at(self.now + delay, "trained", str(t), str(self.incarnation))

    def group_done(self, gid: str) -> None:
        w = self.group_version[gid]
        if self.rng.random() < self.p.p_fail:
            where = self.o.can_place(self.p.g, version=w)
            outcome = self.q.fail(gid, retry_allowed=where is not None)
            if outcome.retried:
                self.n_groups += 1
                rids = [f"{gid}/r{self.n_groups}/{j}" for j in range(self.p.g)]
                assert self.o.place(rids, version=w) == where
                self.q.start(gid)
                self.start_requests(gid, rids, w)
            self.receive(outcome.assigned)
        elif self.rng.random() < self.p.p_filter:
            self.filtered.add(gid)
            self.receive(self.q.complete(gid, filtered=True))
        else:
            self.receive(self.q.complete(gid))

    def trained_step(self, t: int) -> None:
        self.trainer_busy = False
        self.trained[t] = self.inbox.pop(t)
        if self.p.k == 0:
            assert [a.version for a in self.trained[t]] == [t] * self.p.b
        assert self.q.on_step_done(t, incarnation=self.incarnation)
        if (t + 1) % self.p.checkpoint_every == 0:
            self.durable = t
            self.q.on_durable(t, incarnation=self.incarnation)
        self.trainer_step = t + 1
        if t + 1 < self.p.steps:
            self.apply(self.o.publish(t + 1))
            if self.rng.random() < self.p.p_restart:
                crash_at = self.now + self.rng.uniform(0, 3 * self.p.train_time)
                self.at(crash_at, "crash", str(self.incarnation))
        self.maybe_train()

    def restart(self) -> None:
        """The trainer crashes and restarts from its last durable checkpoint."""
        c = self.durable
        # Partial mode: a group of a real first version may hold tokens of a ghost version.
        tainted = {
            self.group_of[rid]
            for rid, seg in self.segments.items()
            if seg[-1] > c + 1 and self.q.state(self.group_of[rid]) is not None
        }
        requests: dict[str, list[str]] = {}
        for rid, gid in self.group_of.items():
            requests.setdefault(gid, []).append(rid)
        out = rollback(self.q, self.o, c, tainted=tainted, requests=lambda g: requests.get(g, []))
        report = out.report
        assert tainted <= set(report.rolled_back)
        self.incarnation = report.incarnation
        self.trainer_step, self.trainer_busy = c + 1, False
        self.inbox = {}
        self.trained = {s: b for s, b in self.trained.items() if s <= c}
        ghosts = set(report.rolled_back)
        self.rolled_back |= ghosts
        for rid in [r for r in self.end if self.group_of[r] in ghosts]:
            del self.end[rid]
            self.tok[rid] += 1
        for rid in [r for r in self.left if self.group_of[r] in ghosts]:
            del self.left[rid]
        for gid in ghosts:
            self.pending.pop(gid, None)
        assert not any(self.o.is_live(r) for g in ghosts for r in requests.get(g, []))
        self.apply(out.actions)
        self.receive(report.assigned)

    def step(self) -> bool:
        if not self.events:
            return False
        self.now, _, ev = heapq.heappop(self.events)
        kind = ev[0]
        if kind == "done":
            rid, t = ev[1], int(ev[2])
            if self.tok.get(rid) != t or rid not in self.end:
                return True
            del self.end[rid]
            self.apply(self.o.finish(rid))
            gid = self.group_of[rid]
            self.pending[gid] -= 1
            if self.pending[gid] == 0:
                del self.pending[gid]
                self.group_done(gid)
        elif kind == "loaded":
            # Every completed load is reported, also those the orchestrator superseded since:
            # the load's identity, not this driver, tells them apart.
            load = self.loads.pop(int(ev[1]))
            if self.o.is_pending(load):
                self.q.on_version_loaded(load.version, incarnation=self.incarnation)
            self.apply(self.o.on_loaded(load))
        elif kind == "trained":
            if int(ev[2]) == self.incarnation:
                self.trained_step(int(ev[1]))
        elif kind == "crash":
            if int(ev[1]) == self.incarnation and self.trainer_step < self.p.steps:
                self.restart()
        elif kind == "kill":
            views = self.o.instances()
            if views:
                victim = self.rng.choice(views).id
                self.draining.discard(victim)
                self.apply(self.o.remove_instance(victim))
                self.at(self.now + self.p.load_time * 2, "revive")
            self.failures_left -= 1
            if self.failures_left:
                self.at(self.now + self.rng.uniform(0, 5 * self.p.train_time), "kill")
        elif kind == "revive":
            self.add_instance()
        self.pump()
        self.check()
        return True

    def check(self) -> None:
        """What must hold after every event."""
        q, o, p = self.q, self.o, self.p
        q.check_invariant()
        acc = q.accounting()
        assert acc.admitted == acc.consumed + acc.filtered + acc.rolled_back + acc.unassigned
        loaded = o.loaded_versions()
        self.max_versions = max(self.max_versions, len(loaded))
        assert len(loaded) <= p.k + 1, (loaded, q.step)
        if p.mode is not Mode.DORA:  # the other modes switch all instances at once
            assert len(loaded) <= 1, loaded
        # One load per instance per change of the inputs, by the rules alone (every mode).
        assert o.held_back_loads == 0
        views = {v.id: v for v in o.instances()}
        for v in views.values():
            assert v.load <= v.capacity
            # The actions alone tell the driver which instances accept new groups.
            assert v.draining == (v.id in self.draining), (v, self.draining)
        for rid in self.end:  # running, not parked: its instance holds its version
            where = o.location(rid)
            assert where is not None
            if p.mode is Mode.INFLIGHT:  # its instance holds or loads (under it) its version
                assert o.request_version(rid) == views[where].version, (rid, views[where])
            else:
                assert o.request_version(rid) in o.held_versions(where), (rid, views[where])  # C1
            if p.mode not in (Mode.PARTIAL, Mode.INFLIGHT):
                assert self.segments[rid] == [self.group_version[self.group_of[rid]]] * len(
                    self.segments[rid]
                )
            else:
                assert self.segments[rid][0] == self.group_version[self.group_of[rid]]

    def run(self, max_events: int = 200_000) -> None:
        self.pump()
        for _ in range(max_events):
            if self.trainer_step >= self.p.steps:
                return
            if not self.step():
                break
        raise AssertionError(
            f"stuck: trainer at {self.trainer_step}, queue at {self.q.step}, "
            f"{self.q.accounting()}, queue={self.q.version_counts()}, "
            f"live={self.o.live()}, instances={self.o.instances()}"
        )
