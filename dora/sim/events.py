"""The event loop: simulated instances and a simulated trainer on a virtual clock, driving the real
`TransferQueue` and `Orchestrator` (dora/core) unchanged.

Instances (continuous batching, as vLLM does it). Each instance runs at most `max_seqs`
sequences; every running sequence decodes one token per engine step, and a step takes
`t0 + c * b + k * S` seconds (`b` running sequences, `S` context tokens in all, dora.costs). Between
two events `b` is constant and `S` grows by `b` per step, so the tokens decoded in `dt` seconds
solve a quadratic: time advances from one completion (or KV-cache exhaustion) to the next, never
token by token. Each instance keeps a heap of the progress marks at which its sequences finish.
When the KV cache is full the most recently started sequence is preempted and later re-prefilled
(vLLM's recompute preemption); waiting sequences start when their context fits. Prefill pauses
decode for its duration (a simplification of chunked prefill).

The driver follows the sans-IO contract (docs/scheduling.md):
- a group is admitted only at the newest published version, once an instance holds it and has
  room for all `G` samples (bind late; docs/scheduling.md, "Admission"); the group starts at once,
  so its version is frozen;
- the driver mirrors which instances accept groups from the actions alone (`Drain` stops one,
  `Undrain` or a `Load` ends it), and reports its backlog to the orchestrator (`set_demand`: the
  samples of every group the queue would admit, while they wait for an instance of the newest
  version), so old versions are consolidated only as far as the newest version needs the room;
- every instance has a KV-cache capacity in tokens, and the driver reports each live request's
  context length (`set_size`) at each publish and at each turn end, so consolidation never packs
  an old version's long survivors beyond it (between two reports the sizes are an underestimate);
- every action of the orchestrator is carried out in order: `Load` takes `weight_sync_s`,
  `Migrate` moves the sequence with its KV cache (or re-prefills it), `Park` keeps the tokens so
  far and drops the KV cache, `Resume` re-prefills;
- completed groups go to the queue; what it assigns goes to the simulated trainer (steps.py).
  Colocated modes pause every instance while the trainer holds the GPUs.
"""

from __future__ import annotations

import heapq
from collections import Counter

from dora.core import Admitted, Assigned, RefusalReason, TransferQueue
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
)
from dora.costs import Setup, decode_seconds, decode_steps
from dora.errors import SchedulingError
from dora.sim.modes import ModePlan
from dora.sim.state import Group, Inst, Req, Run
from dora.sim.steps import Steps
from dora.sim.workload import Workload, chain_s

__all__ = ["Run", "simulate"]

_INST, _LOADED, _TRAINED, _TOOL, _POLL = range(5)
_POLL_S = 10.0
_EPS = 1e-7


class _Sim:
    def __init__(self, setup: Setup, plan: ModePlan, *, seed: int) -> None:
        self.s = setup
        self.p = plan
        self.run = Run(plan.name, plan, setup)
        self.co = setup.decode_coefficients()
        self.kvcap = setup.kv_capacity_tokens
        self.workload = Workload(setup, seed=seed)
        self.q = TransferQueue(
            groups_per_step=setup.groups_per_step,
            max_staleness=plan.staleness,
            num_steps=setup.steps,
        )
        n_shards = -(-plan.instances // setup.controller_instances)
        self.orchs = [Orchestrator(mode=plan.orchestrator) for _ in range(n_shards)]
        self.now = 0.0
        self.events: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.insts: dict[str, Inst] = {}
        self.index: dict[str, int] = {}
        self.reqs: dict[str, Req] = {}
        self.groups: dict[str, Group] = {}
        self.roomy: dict[int, dict[int, set[str]]] = {}  # version -> shard -> instances
        self.n_groups = 0
        self.newest = 0
        self.paused = False
        self.demand = 0  # samples reported to the orchestrators as waiting for room
        self.done = False
        self.steps = Steps(setup, plan, self.run)
        self.last = 0.0  # integrals over time since `last`
        self.n_busy = self.n_running = 0
        self.acc_busy = self.acc_running = self.acc_train = self.acc_rollout = 0.0

    # --- plumbing ------------------------------------------------------------------------------

    def at(self, when: float, kind: int, obj: object, arg: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, obj, arg))

    def integrate(self, now: float) -> None:
        dt = now - self.last
        if dt <= 0:
            return
        train = max(0.0, min(now, self.steps.until) - self.last)
        self.acc_busy += self.n_busy * dt
        self.acc_running += self.n_running * dt
        self.acc_train += train
        if self.n_busy:
            self.acc_rollout += dt - train
        self.last = now

    def main(self) -> Run:
        per = self.s.controller_instances
        for i in range(self.p.instances):
            iid = f"i{i}"
            self.insts[iid] = Inst(iid, i // per)
            self.index[iid] = i
            tokens = int(self.kvcap * (1.0 - self.s.kv_watermark))
            orch = self.orchs[i // per]
            self.apply(orch.add_instance(iid, capacity=self.s.max_seqs, tokens=tokens))
        self.at(_POLL_S, _POLL, None)
        while self.events and not self.done:
            when, _, kind, obj, arg = heapq.heappop(self.events)
            self.integrate(when)
            self.now = when
            self.run.events += 1
            if kind == _INST:
                assert isinstance(obj, Inst)
                if arg == obj.token:
                    self.on_instance(obj)
            elif kind == _TOOL:
                assert isinstance(obj, Req)
                self.on_tool(obj)
            elif kind == _LOADED:
                assert isinstance(obj, Inst)
                if obj.load is not None and arg == obj.load.id:  # a later Load supersedes it
                    self.on_loaded(obj, obj.load)
            elif kind == _TRAINED:
                assert isinstance(obj, int)
                self.on_trained(obj)
            else:
                for o in self.orchs:
                    self.apply(o.rebalance())
                self.pump()
                if not self.events:
                    break  # nothing can happen any more: a deadlock, reported below
                self.at(self.now + _POLL_S, _POLL, None)
        if not self.done:
            raise SchedulingError(f"{self.p.name}: the run stalled at step {self.q.step}")
        return self.finish_run()

    # --- instances -----------------------------------------------------------------------------

    def sync(self, inst: Inst) -> None:
        """Advance `inst` to now (no event of its own happened in between)."""
        dt = (self.now - inst.t) / self.slowdown()
        inst.t = self.now
        if dt <= 0 or inst.paused or not inst.ready:
            return
        if inst.stall > 0:
            use = min(inst.stall, dt)
            inst.stall -= use
            dt -= use
        b = len(inst.running)
        if b == 0 or dt <= 0:
            return
        dp = decode_steps(self.co, b, inst.kv, dt)
        inst.prog += dp
        inst.kv += b * dp

    def kick(self, inst: Inst) -> None:
        """Start waiting sequences, then schedule the instance's next event."""
        if inst.ready and not inst.paused:
            self.start_waiting(inst)
        busy = inst.ready and not inst.paused and (bool(inst.running) or inst.stall > 0)
        if busy != inst.busy:
            # shared cores: every other busy instance speeds up or slows down from now on
            others = []
            if self.s.shared_cores:
                others = [i for i in self.insts.values() if i.busy and i is not inst]
                for other in others:
                    self.sync(other)
            self.n_busy += 1 if busy else -1
            inst.busy = busy
            for other in others:
                self.schedule(other)
        self.schedule(inst)

    def slowdown(self) -> float:
        """How much longer a step takes while `n_busy` instances share the pool's cores."""
        if not self.s.shared_cores:
            return 1.0
        cores = self.s.gpus if self.p.colocated else self.s.rollout_gpus
        return max(1.0, self.n_busy * self.s.gpus_per_instance / cores)

    def schedule(self, inst: Inst) -> None:
        """The instance's next event: its next completion or a full KV cache."""
        inst.token += 1
        if not inst.running or inst.paused or not inst.ready:
            return
        heap = inst.heap
        while heap:
            mark, _, req = heap[0]
            if req.inst is inst and req.where == 2 and req.mark == mark:
                break
            heapq.heappop(heap)
        b = len(inst.running)
        dp = heap[0][0] - inst.prog
        dp = max(0.0, min(dp, (self.kvcap - inst.kv) / b))
        dt = inst.stall + decode_seconds(self.co, b, inst.kv, dp)
        dt *= self.slowdown()
        inst.target = inst.prog + dp
        self.at(self.now + dt, _INST, inst, inst.token)

    def start_waiting(self, inst: Inst) -> None:
        limit = self.kvcap * (1.0 - self.s.kv_watermark)
        waiting, running = inst.waiting, inst.running
        while waiting and len(running) < self.s.max_seqs:
            req = waiting[0]
            if running and inst.kv + req.ctx > limit:
                break
            waiting.popleft()
            if req.cached < 0:
                inst.stall += self.s.prefill_s(0.0, req.ctx) / self.s.group_size
            else:
                inst.stall += self.s.prefill_s(req.cached, req.ctx - req.cached)
            req.cached = req.ctx
            req.where = 2
            req.ctx0 = req.ctx
            req.p0 = inst.prog
            req.mark = inst.prog + req.remaining
            running[req.rid] = req
            self.seq += 1
            heapq.heappush(inst.heap, (req.mark, self.seq, req))
            inst.kv += req.ctx
            self.n_running += 1

    def stop(self, inst: Inst, req: Req) -> None:
        """Take `req` off `inst` (it must be synced): its progress is kept."""
        if req.where == 2:
            del inst.running[req.rid]
            req.ctx = req.ctx0 + (inst.prog - req.p0)
            req.cached = req.ctx  # its KV cache covers every token so far (until dropped)
            req.remaining = max(0.0, req.mark - inst.prog)
            inst.kv -= req.ctx
            self.n_running -= 1
            if not inst.running:
                inst.kv = 0.0
                inst.stall = 0.0
        elif req.where == 1:
            inst.waiting.remove(req)
        req.where = 0

    def on_instance(self, inst: Inst) -> None:
        b = len(inst.running)
        dp = inst.target - inst.prog
        inst.stall = 0.0
        inst.prog = inst.target
        inst.kv += b * dp
        inst.t = self.now
        heap = inst.heap
        while heap and heap[0][0] <= inst.prog + _EPS:
            mark, _, req = heapq.heappop(heap)
            if req.inst is inst and req.where == 2 and req.mark == mark:
                self.stop(inst, req)
                # at once: the orchestrator's answer may move the other sequences
                self.turn_done(req)
        while inst.running and inst.kv >= self.kvcap - 1e-6:
            rid = next(reversed(inst.running))
            req = inst.running[rid]
            self.stop(inst, req)
            req.cached = 0.0  # recompute preemption: the KV cache is freed
            req.where = 1
            inst.waiting.appendleft(req)
            self.run.preemptions += 1
        self.kick(inst)
        self.pump()

    def turn_done(self, req: Req) -> None:
        req.turn += 1
        ep = req.ep
        if req.turn < len(ep.turns):
            self.report_size(req, int(req.ctx))
            req.tool_pending = True
            self.at(self.now + ep.tool_s[req.turn - 1], _TOOL, req)
            return
        inst = req.inst
        assert inst is not None
        inst.used -= 1
        self.update_room(inst)
        del self.reqs[req.rid]
        self.run.spans[req.v_last - req.v_first + 1] += 1
        self.apply(self.orchs[req.shard].finish(req.rid))
        g = req.group
        g.left -= 1
        if g.left == 0:
            g.done_s = self.now
            self.assigned(self.q.complete(g.gid))

    def on_tool(self, req: Req) -> None:
        if req.rid not in self.reqs:
            return
        req.tool_pending = False
        req.ctx += self.s.tool_tokens
        req.remaining = float(req.ep.turns[req.turn])
        inst = req.inst
        if inst is None:
            return  # parked: it continues on Resume
        self.sync(inst)
        req.where = 1
        inst.waiting.append(req)
        self.kick(inst)

    def update_room(self, inst: Inst) -> None:
        room = (
            inst.version
            if inst.ready
            and not inst.draining
            and inst.version is not None
            and self.s.max_seqs - inst.used >= self.s.group_size
            else None
        )
        if room == inst.roomy:
            return
        if inst.roomy is not None:
            shards = self.roomy[inst.roomy]
            shards[inst.shard].discard(inst.id)
            if not shards[inst.shard]:
                del shards[inst.shard]
        if room is not None:
            self.roomy.setdefault(room, {}).setdefault(inst.shard, set()).add(inst.id)
        inst.roomy = room

    def segment(self, inst: Inst, version: int) -> None:
        if inst.version is not None and self.now > inst.seg_start:
            self.run.segments.append((self.index[inst.id], inst.seg_start, self.now, version))
        inst.seg_start = self.now

    # --- orchestrator actions ------------------------------------------------------------------

    def apply(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Load):
                inst = self.insts[a.instance]
                self.sync(inst)
                if inst.used:
                    if self.p.orchestrator is not Mode.INFLIGHT:
                        raise SchedulingError(f"Load on {inst.id} which holds {inst.used} requests")
                    for req in (r for r in self.reqs.values() if r.inst is inst):
                        req.v_last = a.version  # its next tokens are a.version's
                self.segment(inst, inst.version if inst.ready and inst.version is not None else -1)
                inst.version = a.version
                inst.ready = False
                inst.draining = False
                inst.load = a
                self.update_room(inst)
                self.kick(inst)
                delay = self.s.weight_sync_s if self.now > 0 else 0.0
                self.run.loads += 1
                self.at(self.now + delay, _LOADED, inst, a.id)
            elif isinstance(a, Migrate):
                req = self.reqs[a.request]
                src, dst = self.insts[a.src], self.insts[a.dst]
                self.sync(src)
                self.sync(dst)
                self.stop(src, req)
                src.used -= 1
                dst.used += 1
                req.inst = dst
                self.run.migrations += 1
                if req.cached >= 0 and not req.tool_pending:
                    if self.s.migrate_kv:
                        gb = req.cached * self.s.kv_bytes_per_token / 1e9
                        self.run.migrated_gb += gb
                        dst.stall += gb / self.s.kv_transfer_gbps
                    else:
                        req.cached = 0.0
                if not req.tool_pending:
                    req.where = 1
                    dst.waiting.append(req)
                self.update_room(src)
                self.update_room(dst)
                self.kick(src)
                self.kick(dst)
            elif isinstance(a, Park):
                req = self.reqs[a.request]
                inst = self.insts[a.instance]
                self.sync(inst)
                self.stop(inst, req)
                inst.used -= 1
                req.inst = None
                if req.cached >= 0:
                    req.cached = 0.0  # the KV cache is dropped; a resume re-prefills
                self.run.parks += 1
                self.update_room(inst)
                self.kick(inst)
            elif isinstance(a, Resume):
                req = self.reqs[a.request]
                inst = self.insts[a.instance]
                self.sync(inst)
                inst.used += 1
                req.inst = inst
                req.v_last = a.version
                if not req.tool_pending:
                    req.where = 1
                    inst.waiting.append(req)
                self.update_room(inst)
                self.kick(inst)
            else:
                assert isinstance(a, (Drain, Undrain))
                inst = self.insts[a.instance]
                inst.draining = isinstance(a, Drain)
                self.update_room(inst)

    def on_loaded(self, inst: Inst, load: Load) -> None:
        assert inst.version is not None
        self.segment(inst, -1)
        inst.ready = True
        inst.t = self.now
        self.q.on_version_loaded(inst.version)
        self.update_room(inst)
        self.apply(self.orchs[inst.shard].on_loaded(load))
        self.kick(inst)
        self.pump()

    # --- admission -----------------------------------------------------------------------------

    def pump(self) -> None:
        q, s = self.q, self.s
        v = self.newest
        while not self.paused:
            blocker = q.admission_blocker(version=v)
            shards = self.roomy.get(v)
            if blocker is not None or not shards:
                # Admissible work waits for an instance of the newest version (none holds it or
                # has room yet): tell the orchestrators all of it, so that they free in one plan
                # as many old-version instances as it needs, loading them side by side.
                waiting = blocker in (None, RefusalReason.WEIGHTS_NOT_LOADED)
                self.report_demand(s.group_size * q.admissible(v) if waiting else 0)
                return
            shard = next(iter(shards))
            gid = f"g{self.n_groups + 1}"
            rids = [f"{gid}/{j}" for j in range(s.group_size)]
            where = self.orchs[shard].place(rids, version=v)
            if where is None:
                raise SchedulingError(f"place refused on shard {shard}, which has room")
            self.n_groups += 1
            out = q.try_admit(gid, version=v)
            if not isinstance(out, Admitted):
                raise SchedulingError(f"admission refused after the check: {out}")
            q.start(gid)
            inst = self.insts[where]
            self.sync(inst)
            eps = self.workload.group()
            chain = max(chain_s(s, e) for e in eps)
            group = Group(gid, v, len(eps), sum(e.tokens for e in eps), chain, self.now)
            self.groups[gid] = group
            for rid, ep in zip(rids, eps, strict=True):
                req = Req(rid, group, ep, v)
                req.inst = inst
                req.shard = shard
                req.where = 1
                self.reqs[rid] = req
                inst.waiting.append(req)
            inst.used += s.group_size
            self.update_room(inst)
            self.kick(inst)

    def report_demand(self, requests: int) -> None:
        if requests != self.demand:
            self.demand = requests
            for o in self.orchs:
                self.apply(o.set_demand(requests))

    def report_sizes(self) -> None:
        """Tell the orchestrators every live request's context length (before a publish)."""
        for inst in self.insts.values():
            self.sync(inst)
        for req in self.reqs.values():
            ctx = req.ctx
            if req.where == 2 and req.inst is not None:
                ctx = req.ctx0 + (req.inst.prog - req.p0)
            self.report_size(req, int(ctx))

    def report_size(self, req: Req, ctx: int) -> None:
        if self.orchs[req.shard].set_size(req.rid, ctx):  # a `Fail`: the workload cannot fail
            raise SchedulingError(
                f"{self.p.name}: request {req.rid} has {ctx} context tokens, more than any "
                "instance's KV cache holds; raise the KV memory or lower the output lengths"
            )

    # --- trainer -------------------------------------------------------------------------------

    def assigned(self, out: list[Assigned]) -> None:
        for a in out:
            self.take(a, self.groups.pop(a.group_id))

    def take(self, a: Assigned, group: Group) -> None:
        end = self.steps.take(a, group, self.now)
        if end is None:
            return
        if self.p.colocated:
            self.pause_all()  # the trainer holds every GPU until the step is trained
        self.at(end, _TRAINED, a.step)

    def pause_all(self) -> None:
        self.paused = True
        for inst in self.insts.values():
            self.sync(inst)
            inst.paused = True
            self.kick(inst)

    def on_trained(self, step: int) -> None:
        self.q.on_step_done(step)
        self.q.on_durable(step)
        run = self.run
        run.step_end_s.append(self.now)
        self.steps.record(step)
        run.snapshots.append(
            (self.now, self.acc_busy, self.acc_running, self.acc_train, self.acc_rollout)
        )
        run.versions.append(
            dict(Counter(i.version for i in self.insts.values() if i.version is not None))
        )
        if step == self.s.steps - 1:
            self.done = True
            return
        if self.paused and self.steps.until <= self.now + _EPS:
            self.paused = False
            for inst in self.insts.values():
                inst.paused = False
                inst.t = self.now
                self.kick(inst)
        self.newest = step + 1
        self.report_sizes()
        for o in self.orchs:
            self.apply(o.publish(step + 1))
        self.pump()

    def finish_run(self) -> Run:
        run = self.run
        for inst in self.insts.values():
            if inst.version is not None:
                self.segment(inst, inst.version if inst.ready else -1)
        run.admission_waits = {r.value: n for r, n in self.q.admission_waits().items() if n}
        acc = self.q.accounting()
        run.accounting = {
            k: getattr(acc, k) for k in ("admitted", "consumed", "filtered", "unassigned")
        }
        return run


def simulate(setup: Setup, plan: ModePlan, *, seed: int = 0) -> Run:
    """Run one mode to the end of `setup.steps` train steps."""
    return _Sim(setup, plan, seed=seed).main()
