"""The orchestrator's rules: where each version runs, as functions over the pool's state.

`plan(pool)` applies the rules of the pool's mode once and returns the actions, in order; the
orchestrator (`orchestrator.py`) calls it after every event that may change a decision. The
rules themselves are stated in the orchestrator's module docstring. Every change of state goes
through the pool's helpers (`pool.py`), so the indexes never disagree with the instances.
"""

from __future__ import annotations

from dora.core.actions import Action, Drain, Migrate, Mode, Resume, Undrain
from dora.core.pool import UNLIMITED, Pool, PoolInstance

__all__ = ["consolidating", "plan"]


def plan(pool: Pool) -> list[Action]:
    actions: list[Action] = []
    pool.deferred = False
    if pool.mode is Mode.ONE_STEP_OFF:
        plan_one_step_off(pool, actions)
    elif pool.mode in (Mode.PARTIAL, Mode.INFLIGHT):
        for inst in pool.idle_not_newest():
            if pool.retargetable(inst):
                pool.load(inst, pool.newest, actions)
    else:
        plan_multi_version(pool, actions)
        return actions
    resume_parked(pool, actions)
    return actions


def plan_one_step_off(pool: Pool, actions: list[Action]) -> None:
    old = sorted(w for w in pool.live if w != pool.newest)
    if not old:
        for inst in [pool.instances[i] for i in pool.draining]:
            pool.set_draining(inst, False)
            if inst.version == pool.newest:
                actions.append(Undrain(inst.id))
        for inst in pool.idle_not_newest():
            if pool.retargetable(inst):
                pool.load(inst, pool.newest, actions)
        return
    # The old version drains; an idle instance serves it only if its requests wait for room
    # (an instance died), and otherwise waits to switch with the others.
    for w in old:
        if pool.parked.get(w) and pool.room(w) is None and not pool.loading.get(w):
            idle = sorted(i for v in pool.empty for i in pool.empty[v])
            pick = next((i for i in idle if pool.retargetable(pool.instances[i])), None)
            if pick is not None:
                pool.load(pool.instances[pick], w, actions)


def plan_multi_version(pool: Pool, actions: list[Action]) -> None:
    newest = pool.newest
    for inst in pool.multi.values():  # the newest version joins what they hold, no drain
        if inst.held is not None and newest not in inst.held and newest not in inst.adding:
            pool.add_version(inst, newest, actions)
    old = sorted(w for w in pool.live if w != newest)
    keep: set[str] = set()
    for w in old:  # deadline order: the oldest version is on the trainer's critical path
        keep |= shrink(pool, w, actions)
    # Parked requests take the room they have before any instance is re-targeted: an idle
    # instance of their version is room, not a surplus to load the newest version on.
    resume_parked(pool, actions)
    for w in old:
        if pool.parked.get(w):  # what is still parked has no room
            grow(pool, w, keep, actions)
    todo = {i.id: i for i in pool.idle_not_newest()}
    todo.update((i, pool.instances[i]) for i in pool.draining)
    for inst in sorted(todo.values(), key=lambda i: i.order):
        if inst.id in keep or inst.requests or inst.id not in pool.instances:
            continue
        if not pool.retargetable(inst):
            continue  # told to load since the inputs changed: no second load for one change
        target = newest
        if inst.draining:
            pool.set_draining(inst, False)
            target = oldest_waiting(pool, default=newest)
            if inst.version == target:
                actions.append(Undrain(inst.id))
        if inst.version != target:
            pool.load(inst, target, actions)
    pool.freed_slots = 0  # `consolidating` counts it only while a plan is made


def shrink(pool: Pool, w: int, actions: list[Action]) -> set[str]:
    """Keep the fewest instances of old version `w` that hold its live requests; migrate the
    requests of the others into them, but only off instances that then become empty, only
    into free slots and free KV tokens, and only while the newest version needs the room."""
    mine = {k: i for k, i in pool.by_version.get(w, {}).items() if i.held is None}
    empty = [k for k in pool.empty.get(w, {}) if k in mine]
    migrate = pool.spare(w) >= pool.min_capacity and consolidating(pool)
    if not migrate and not empty:
        return set(mine)  # nothing can move and nothing is idle: every instance stays
    order = sorted(mine.values(), key=lambda i: (not i.ready, -len(i.requests), i.id))
    kept: list[PoolInstance] = []
    room = room_tokens = 0
    need, need_tokens = pool.live.get(w, 0), pool.live_tokens.get(w, 0)
    for inst in order:
        # Slots and KV tokens count alike: kept instances must hold the version's live
        # requests by both, or an emptied one is released and asked for again.
        enough = room >= need and room_tokens >= need_tokens
        if enough and not inst.requests:
            continue
        if (
            migrate
            and enough
            and inst.ready
            and pool.retargetable(inst)
            and consolidating(pool)  # an instance freed already may be the room needed
            and move_all(pool, inst, kept, actions)
        ):
            pool.freed_slots += inst.capacity  # loads the newest version in this plan
            continue
        kept.append(inst)
        room += inst.capacity
        room_tokens += UNLIMITED if inst.tokens is None else inst.tokens
    return {k.id for k in kept}


def move_all(
    pool: Pool, inst: PoolInstance, kept: list[PoolInstance], actions: list[Action]
) -> bool:
    """Migrate every request of `inst` into `kept` (largest first, each to the instance with
    the most free slots that also has the KV tokens), or move none and return False."""
    targets = [k for k in kept if k.ready]
    if sum(k.free for k in targets) < len(inst.requests):
        return False
    plan: list[tuple[str, PoolInstance]] = []
    free = {k.id: k.free for k in targets}
    tokens = {k.id: k.used_tokens for k in targets}
    for rid in sorted(inst.requests, key=lambda r: (-pool.requests[r].size, r)):
        size = pool.requests[rid].size
        fit = [
            k
            for k in targets
            if free[k.id] > 0 and (k.tokens is None or tokens[k.id] + size <= k.tokens)
        ]
        if not fit:
            return False
        dst = max(fit, key=lambda k: free[k.id])
        free[dst.id] -= 1
        tokens[dst.id] += size
        plan.append((rid, dst))
    for rid, dst in sorted(plan):
        pool.detach(inst, rid)
        pool.attach(dst, rid)
        actions.append(Migrate(rid, inst.id, dst.id))
    return True


def grow(pool: Pool, w: int, keep: set[str], actions: list[Action]) -> None:
    """Old version `w` has parked requests and no room for them: give it, in this one plan,
    as many instances as its parked requests need (packed as they would resume) beside the
    ones already loading it, so that no load completion asks for more. A multi-version
    instance with room loads `w` beside its versions first (nothing drains)."""
    if pool.multi:
        if any(w in i.adding for i in pool.multi.values()):
            return  # room to come
        head = pool.requests[pool.parked[w][0]].size
        roomy = [i for i in pool.multi.values() if i.version is not None and i.fits(head)]
        if roomy:
            pool.add_version(min(roomy, key=lambda i: (-i.free, i.order)), w, actions)
            return
    keep.update(pool.loading.get(w, {}))  # room to come for `w`: not to be re-targeted
    targets = pool.targets(w)
    queue = pool.parked[w]
    held = pool.parked_fit(w, targets)
    if held == len(queue):
        return
    spare = sorted(
        (
            i
            for i in pool.instances.values()
            if i.id not in keep and not i.requests and not i.draining and i.held is None
        ),
        key=lambda i: (i.version == pool.newest and i.ready, i.id),
    )
    for inst in spare:
        if not inst.fits(pool.requests[queue[held]].size):
            continue
        if inst.version != w and not pool.retargetable(inst):
            continue
        keep.add(inst.id)
        if inst.version != w:
            pool.load(inst, w, actions)
        targets.append(inst)
        held = pool.parked_fit(w, targets)
        if held == len(queue):
            return
    if pool.draining:
        return  # one is already on its way
    size = pool.requests[queue[held]].size
    newest = [
        i
        for i in pool.instances.values()
        if i.id not in keep
        and i.requests
        and i.held is None
        and (i.tokens is None or i.tokens >= size)
    ]
    if newest:
        inst = min(newest, key=lambda i: (len(i.requests), i.id))
        pool.set_draining(inst, True)
        actions.append(Drain(inst.id))


def oldest_waiting(pool: Pool, *, default: int) -> int:
    """The oldest version whose parked requests still need an instance: no room, and not
    held by the instances loading it (a load for it would be re-targeted once they are in)."""
    waiting = [
        w for w, rs in pool.parked.items() if rs and pool.parked_fit(w, pool.targets(w)) < len(rs)
    ]
    return min(waiting, default=default)


def resume_parked(pool: Pool, actions: list[Action]) -> None:
    for w in sorted(pool.parked):
        queue = pool.parked[w]
        while queue:
            run_on = pool.newest if pool.mode in (Mode.PARTIAL, Mode.INFLIGHT) else w
            rid = queue[0]
            req = pool.requests[rid]
            dst = pool.room(run_on, req.size)
            if dst is None:
                break
            queue.pop(0)
            if req.version != run_on:
                pool.count_live(req.version, -1, -req.size)
                pool.count_live(run_on, 1, req.size)
                req.version = run_on
            pool.attach(dst, rid)
            actions.append(Resume(rid, dst.id, run_on))
    pool.parked = {w: q for w, q in pool.parked.items() if q}


def consolidating(pool: Pool) -> bool:
    """Whether freeing an old version's instance pays: no demand was ever reported, or more
    requests wait than the newest version's loading instances and those this plan freed take."""
    if pool.demand is None:
        return True
    return pool.demand > pool.loading_slots.get(pool.newest, 0) + pool.freed_slots
