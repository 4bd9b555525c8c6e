"""The transfer queue: the staleness gate that keeps C2 (every admitted group consumed once, or
counted) and C3 (`0 <= t - w <= K`) by construction. Pure: no I/O, no clock, no asyncio.

State: the step `t` being filled, its free slots `f`, and for every unassigned group (admitted,
running or completed) its deadline `d = min(w + K, T - 1)`. With `U(<= s)` the unassigned groups of
deadline `<= s` and `cap(s) = f + (s - t) * B`, the queue keeps, after every operation,

    for every s >= t:  U(<= s) <= cap(s)                                    (the invariant)

Every deadline lies in `[t, t + K]` (versions are never newer than `t`), so the queue keeps the
counts of unassigned groups per deadline in a list indexed by `d - t`; checking the invariant is
then O(K). Completed groups wait in a heap ordered by deadline (earliest deadline first), so every
operation costs O(K + log n), whatever the length of the run or the size of a step (a `Durable`
included: the book of groups, `groups.py`, releases a step's groups lazily). Memory does not grow
with the run either, once steps are durable: the loaded versions are pruned once a step to those
a call can still ask about, and the incarnation per version is kept per roll-back.

Strict inputs: `on_step_done` takes the steps in order, `on_durable` only a filled step, and
`rollback` only a step the trainer reported trained; anything else is a driver bug and raises.

Rules (docs/scheduling.md):
- admission at version `w` needs (a) `w + K >= t` and (b) room for one more group of deadline
  `w + K` in the invariant; `w` is the newest loaded version unless `admit_old_versions` is on;
- a group whose episodes were lost with their process is admitted again (`restart`) at a loaded
  version not older than its own (that moves its deadline later and never raises any `U(<= s)`);
  `start` freezes the version;
- a completed group is assigned to step `t` only if the invariant holds afterwards, earliest
  deadline first; when `f` reaches 0 the step closes and `t` advances. Assignments are returned by
  the call that unlocked them (`complete`, `filter`, `restart`, `rollback`, a failure that masks);
- a completed group may be filtered (removed and counted); a failed group is retried at its
  version (at most `max_retries` times) or masked: it completes with masked samples and is
  consumed like any other group;
- groups stay until the step that consumed them is durable (`on_durable`);
- a group whose episodes were lost with the process that ran them (a `dora serve` restored from
  its journal) is restarted (`restart`): it goes back to admitted, unpinned, re-bound to a loaded
  version no older than its own (a later deadline never raises any `U(<= s)`), and is counted;
- `rollback(c)` after a trainer restart from the checkpoint of step `c`: steps `<= c` are durable,
  filling continues at step `c + 1` with version `c + 1`; groups of versions `<= c + 1` are offered
  again, groups of later ("ghost") versions are removed and counted as rolled back, and the
  trainer's incarnation advances so that messages of the lost run are ignored.

Accounting, always: admitted = consumed + filtered + rolled_back + unassigned (0 at the end).
`consumed` counts groups assigned to a step that no roll-back has undone.

Non-obvious choices:
- Version numbers stay plain `int` (STYLE.md); the incarnation that published each version is
  kept beside it (`version_tag`), and every trainer message may carry its incarnation: a message
  from an older incarnation is ignored and counted, so a ghost is never taken for a real version.
- The queue knows nothing about instances. "No capacity" is a reason the driver records
  (`record_admission_wait(RefusalReason.NO_CAPACITY)`); the queue reports the other reasons.

Usage by an event-driven driver (the server and the simulator do exactly this)::

    q = TransferQueue(groups_per_step=B, max_staleness=K, num_steps=T)
    q.on_version_loaded(0)                  # an instance holds version 0
    match q.try_admit("g1"):                # an instance of the newest version has room for G
        case Admitted(version=w): start_on_instance("g1", w); q.start("g1")
        case Refused(reason=r): wait(r)
    for a in q.complete("g1"):              # the group's G samples are done and scored
        send_to_trainer(a.group_id, a.step)
    q.on_step_done(0)                       # StepDone(0): version 1 is published
    q.on_durable(0)                         # Durable(0): groups of step 0 may be forgotten
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Collection

from dora.core.groups import _STATE_INDEX, GroupBook, _Group
from dora.core.outcomes import (
    Accounting,
    Admitted,
    Assigned,
    FailureOutcome,
    GroupState,
    Refusal,
    RefusalReason,
    Refused,
    RollbackReport,
    VersionCounts,
)
from dora.errors import SchedulingError

# The outcome types are re-exported: a driver may import everything from this module.
__all__ = [
    "Accounting",
    "Admitted",
    "Assigned",
    "FailureOutcome",
    "GroupState",
    "Refusal",
    "RefusalReason",
    "Refused",
    "RollbackReport",
    "TransferQueue",
    "VersionCounts",
]


class TransferQueue(GroupBook):
    """The staleness gate. See the module docstring for the rules and a usage example."""

    def __init__(
        self,
        *,
        groups_per_step: int,
        max_staleness: int,
        num_steps: int | None = None,
        max_retries: int = 0,
        admit_old_versions: bool = False,
    ) -> None:
        if groups_per_step < 1:
            raise SchedulingError(f"groups_per_step must be >= 1, got {groups_per_step}")
        if max_staleness < 0:
            raise SchedulingError(f"max_staleness must be >= 0, got {max_staleness}")
        if num_steps is not None and num_steps < 1:
            raise SchedulingError(f"num_steps must be >= 1 or None, got {num_steps}")
        super().__init__()
        self._b = groups_per_step
        self._k = max_staleness
        self._horizon = None if num_steps is None else num_steps - 1
        self._max_retries = max_retries
        self._admit_old = admit_old_versions
        self._t = 0
        self._f = groups_per_step
        self._due = [0] * (max_staleness + 1)  # unassigned groups per deadline, index d - t
        self._ready: list[tuple[int, int, str]] = []  # completed groups: (deadline, seq, id)
        self._seq = 0
        self._loaded: set[int] = set()
        self._newest: int | None = None
        self._published = 0
        self._trained = -1
        self._incarnation = 0
        # (first version, incarnation that published it) at each change of incarnation: a
        # version's incarnation never falls as versions rise, so this grows per roll-back only.
        self._incarnations: list[tuple[int, int]] = [(0, 0)]
        self._staleness = [0] * (max_staleness + 1)
        self._admission_waits = dict.fromkeys(RefusalReason, 0)
        self._admitted = self._consumed = self._filtered = self._rolled_back = 0
        self._masked = self._retried = self._reoffered = self._ignored = 0
        self._restarted = 0

    # --- read-only views -------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step being filled (`t`)."""
        return self._t

    @property
    def groups_per_step(self) -> int:
        return self._b

    @property
    def max_staleness(self) -> int:
        return self._k

    @property
    def incarnation(self) -> int:
        return self._incarnation

    @property
    def newest_version(self) -> int | None:
        """The newest loaded version, or None before any is loaded."""
        return self._newest

    @property
    def published_version(self) -> int:
        """The newest version the trainer has published in this incarnation."""
        return self._published

    @property
    def trained_step(self) -> int:
        """The last step the trainer reported trained in this incarnation (-1: none)."""
        return self._trained

    @property
    def durable_step(self) -> int:
        """The newest step the trainer made durable (-1: none); a roll-back never goes below it."""
        return self._durable

    @property
    def finished(self) -> bool:
        """Every step of the run is filled."""
        return self._horizon is not None and self._t > self._horizon

    def version_tag(self, version: int) -> tuple[int, int]:
        """`(incarnation that published it, version)`: the identity a journal should store."""
        if version < 0 or version > self._published:
            return (self._incarnation, version)
        i = bisect.bisect_right(self._incarnations, (version, 1 << 62)) - 1
        return (self._incarnations[i][1], version)

    def staleness_histogram(self) -> list[int]:
        """Consumed groups by staleness `t - w`, index 0..K."""
        return list(self._staleness)

    def admission_waits(self) -> dict[RefusalReason, int]:
        """How many refusals of each reason (plus those the driver recorded)."""
        return dict(self._admission_waits)

    def accounting(self) -> Accounting:
        unassigned = sum(self._due)
        return Accounting(
            admitted=self._admitted,
            consumed=self._consumed,
            filtered=self._filtered,
            rolled_back=self._rolled_back,
            unassigned=unassigned,
            masked=self._masked,
            retried=self._retried,
            reoffered=self._reoffered,
            ignored_messages=self._ignored,
            restarted=self._restarted,
        )

    def check_invariant(self) -> None:
        """Raise SchedulingError if `U(<= s) <= cap(s)` fails for some `s >= t` (O(K))."""
        if self._slack_min(0, self._k) < 0:
            raise SchedulingError(f"invariant broken at step {self._t}: due={self._due}")

    # --- admission ---------------------------------------------------------------------------

    def admission_blocker(self, version: int | None = None) -> RefusalReason | None:
        """Why a group at `version` (default: the newest loaded) cannot be admitted now, or None."""
        if self.finished:
            return RefusalReason.HORIZON
        w = self._newest if version is None else version
        if w is None or w not in self._loaded or w + self._k < self._t:
            return RefusalReason.WEIGHTS_NOT_LOADED
        if w != self._newest and not self._admit_old:
            return RefusalReason.NOT_NEWEST
        i = self._deadline_of(w) - self._t
        if self._slack_min(i, self._k) < 1:
            return RefusalReason.INVARIANT
        return None

    def admissible(self, version: int) -> int:
        """How many groups at `version` the gate would admit now, one after another, once an
        instance holds it: 0 when the run is over, the version is too old or older than the
        newest loaded one, or the invariant leaves no room. A driver reports that many groups'
        samples as its demand while they wait for an instance (`Orchestrator.set_demand`)."""
        if self.finished or version + self._k < self._t:
            return 0
        if not self._admit_old and self._newest is not None and version < self._newest:
            return 0
        return max(0, self._slack_min(self._deadline_of(version) - self._t, self._k))

    def try_admit(self, group_id: str, *, version: int | None = None) -> Admitted | Refused:
        """Admit `group_id` at `version` (default: the newest loaded) if both rules allow it.
        Call it when an instance of that version has room for the whole group (bind late)."""
        if self._unpurged:
            self._purge(2)  # each admission forgets two released groups: the backlog never grows
        old = self._groups.get(group_id)
        if old is not None and not self._released(old):
            raise SchedulingError(f"group {group_id!r} is already in the queue")
        reason = self.admission_blocker(version)
        if reason is not None:
            self._admission_waits[reason] += 1
            return Refused(reason)
        w = self._newest if version is None else version
        assert w is not None
        g = _Group(group_id, w, self._deadline_of(w))
        self._groups[group_id] = g
        self._due[g.deadline - self._t] += 1
        self._count(g, +1)
        self._admitted += 1
        return Admitted(group_id, w, g.deadline)

    def record_admission_wait(self, reason: RefusalReason) -> None:
        """Count a wait the driver saw (e.g. NO_CAPACITY), beside the queue's own refusals."""
        self._admission_waits[reason] += 1

    def restart(self, group_id: str, *, version: int) -> list[Assigned]:
        """The group's episodes were lost (their process died) before it was assigned: it is
        admitted again at `version` (loaded, not older than its own), unpinned, with no attempt
        spent; counted in `restarted`. A completed group whose samples were lost restarts too."""
        g = self._get(group_id)
        if g.state is GroupState.ASSIGNED:
            raise SchedulingError(f"group {group_id!r} is assigned; cannot restart")
        if version not in self._loaded or version < g.version:
            raise SchedulingError(f"cannot restart {group_id!r} (v{g.version}) at v{version}")
        self._count(g, -1)
        self._due[g.deadline - self._t] -= 1
        g.state, g.si, g.pinned = GroupState.ADMITTED, _STATE_INDEX[GroupState.ADMITTED], False
        g.version = version
        g.deadline = self._deadline_of(version)
        self._due[g.deadline - self._t] += 1
        self._count(g, +1)
        self._restarted += 1
        return self._assign()

    def start(self, group_id: str) -> None:
        """The group sampled its first token: its version is frozen from now on."""
        g = self._get(group_id)
        if g.state is GroupState.ADMITTED:
            self._move(g, GroupState.STARTED)
        elif g.state is not GroupState.STARTED:
            raise SchedulingError(f"group {group_id!r} is {g.state.value}; cannot start")

    # --- completion --------------------------------------------------------------------------

    def complete(self, group_id: str, *, filtered: bool = False) -> list[Assigned]:
        """The group is done and scored. `filtered=True` drops it by the configured filter.
        Returns the assignments this unlocked, in order."""
        g = self._get(group_id)
        if g.state not in (GroupState.ADMITTED, GroupState.STARTED):
            raise SchedulingError(f"group {group_id!r} is {g.state.value}; cannot complete")
        self._move(g, GroupState.COMPLETED)
        if filtered:
            return self.filter(group_id)
        self._push_ready(g)
        return self._assign()

    def filter(self, group_id: str) -> list[Assigned]:
        """Remove a completed, unassigned group (a configured filter). Always safe."""
        g = self._get(group_id)
        if g.state is not GroupState.COMPLETED:
            raise SchedulingError(f"group {group_id!r} is {g.state.value}; cannot filter")
        self._remove_unassigned(g)
        self._filtered += 1
        return self._assign()

    def fail(self, group_id: str, *, retry_allowed: bool = True) -> FailureOutcome:
        """The group's episode failed. Retry it at its version while retries are left (and the
        driver allows it, e.g. the version is still served); otherwise mask it."""
        g = self._get(group_id)
        if g.state not in (GroupState.ADMITTED, GroupState.STARTED):
            raise SchedulingError(f"group {group_id!r} is {g.state.value}; cannot fail")
        if retry_allowed and g.attempts < self._max_retries:
            g.attempts += 1
            g.pinned = True
            self._move(g, GroupState.ADMITTED)
            self._retried += 1
            return FailureOutcome(group_id, True, ())
        g.masked = True
        self._masked += 1
        return FailureOutcome(group_id, False, tuple(self.complete(group_id)))

    # --- trainer messages ----------------------------------------------------------------------

    def on_version_loaded(self, version: int, *, incarnation: int | None = None) -> bool:
        """An instance now holds `version`. False (ignored) if it is a stale incarnation's."""
        if self._stale(incarnation):
            return False
        if version > self._published:
            raise SchedulingError(f"version {version} loaded but only {self._published} published")
        self._loaded.add(version)
        if self._newest is None or version > self._newest:
            self._newest = version
        return True

    def on_step_done(self, step: int, *, incarnation: int | None = None) -> bool:
        """StepDone(step): the trainer trained `step` and published version `step + 1`."""
        if self._stale(incarnation):
            return False
        if step != self._trained + 1:
            raise SchedulingError(
                f"StepDone for step {step} out of order: expected step {self._trained + 1} "
                "(the trainer trains its steps one after the other)"
            )
        if step >= self._t:
            raise SchedulingError(f"step {step} done but the queue is still filling {self._t}")
        self._trained = step
        self._published = step + 1
        if self._incarnations[-1][1] != self._incarnation:
            self._incarnations.append((step + 1, self._incarnation))
        self._prune_loaded()
        return True

    def on_durable(self, step: int, *, incarnation: int | None = None) -> list[str]:
        """Durable(step): forget groups of steps `<= step`. Returns their ids (prune journals)."""
        if self._stale(incarnation):
            return []
        if step >= self._t:
            raise SchedulingError(
                f"Durable({step}): step {step} was never filled (the queue is filling {self._t})"
            )
        if step < -1:
            raise SchedulingError(f"Durable({step}): a step is >= 0 (-1: none)")
        released = self._release_through(step)
        self._durable = max(self._durable, step)
        self._prune_loaded()
        return released

    def rollback(self, checkpoint_step: int, *, tainted: Collection[str] = ()) -> RollbackReport:
        """The trainer restarted from the checkpoint holding step `checkpoint_step` (-1: from
        scratch). Filling resumes at step `c + 1` with version `c + 1`. `tainted` names groups
        whose first version is real but that hold tokens of a ghost version (partial mode only:
        the queue knows a group's first version, the driver knows its per-token versions); they
        are rolled back with the ghosts."""
        c = checkpoint_step
        if c < self._durable:
            raise SchedulingError(f"rollback to {c} but step {self._durable} is durable")
        if c >= self._t:
            raise SchedulingError(f"rollback to {c} but step {c} was never filled")
        if c > self._trained:
            raise SchedulingError(
                f"rollback to step {c}, which was never trained: the trainer reported steps up "
                f"to {self._trained} (a checkpoint can only hold a trained step)"
            )
        self.on_durable(c)
        self._purge(None)
        self._incarnation += 1
        ghosts = tuple(sorted(w for w in self._loaded if w > c + 1))
        rolled_back: list[str] = []
        reoffered: list[str] = []
        for g in list(self._groups.values()):
            if g.version > c + 1 or g.gid in tainted:
                if g.state is GroupState.ASSIGNED:
                    self._unassign(g)
                self._count(g, -1)
                del self._groups[g.gid]
                rolled_back.append(g.gid)
            elif g.state is GroupState.ASSIGNED:
                self._unassign(g)
                self._move(g, GroupState.COMPLETED)
                reoffered.append(g.gid)
        self._by_step.clear()
        self._step_versions.clear()
        self._rolled_back += len(rolled_back)
        self._reoffered += len(reoffered)
        self._t, self._f = c + 1, self._b
        self._trained = c
        self._published = c + 1
        self._incarnations = [(w, i) for w, i in self._incarnations if w <= c + 1]
        self._loaded -= set(ghosts)
        self._newest = max(self._loaded, default=None)
        self._due = [0] * (self._k + 1)
        self._ready.clear()
        for g in self._groups.values():
            self._due[g.deadline - self._t] += 1
            if g.state is GroupState.COMPLETED:
                self._push_ready(g)
        self.check_invariant()
        assigned = tuple(self._assign())
        return RollbackReport(
            c, self._incarnation, tuple(rolled_back), tuple(reoffered), ghosts, assigned
        )

    # --- internals ---------------------------------------------------------------------------

    def _prune_loaded(self) -> None:
        """Forget loaded versions no call can need: below both the staleness bound (`t - K`:
        admission, re-binding and restarts take no older version) and the first step a
        roll-back may return to (`durable + 1`), except the newest of them (what a roll-back
        there takes for the newest). O(versions kept), once a step."""
        floor = min(self._t - self._k, self._durable + 1)
        old = [w for w in self._loaded if w < floor]
        if len(old) > 1:
            self._loaded.difference_update(sorted(old)[:-1])

    def _stale(self, incarnation: int | None) -> bool:
        if incarnation is None or incarnation == self._incarnation:
            return False
        if incarnation > self._incarnation:
            raise SchedulingError(f"incarnation {incarnation} is ahead of {self._incarnation}")
        self._ignored += 1
        return True

    def _deadline_of(self, version: int) -> int:
        d = version + self._k
        return d if self._horizon is None else min(d, self._horizon)

    def _slack_min(self, lo: int, hi: int) -> int:
        """min over s = t+lo .. t+hi (clipped to the horizon) of cap(s) - U(<= s)."""
        if self._horizon is not None:
            hi = min(hi, self._horizon - self._t)
        u = sum(self._due[:lo])
        best = 1 << 62
        for i in range(lo, hi + 1):
            u += self._due[i]
            best = min(best, self._f + i * self._b - u)
        return best

    def _push_ready(self, g: _Group) -> None:
        self._seq += 1
        heapq.heappush(self._ready, (g.deadline, self._seq, g.gid))

    def _drop_stale_heads(self) -> None:
        ready = self._ready
        while ready:
            g = self._groups.get(ready[0][2])
            if g is not None and g.state is GroupState.COMPLETED and g.deadline == ready[0][0]:
                return
            heapq.heappop(ready)

    def _remove_unassigned(self, g: _Group) -> None:
        self._due[g.deadline - self._t] -= 1
        self._count(g, -1)
        del self._groups[g.gid]

    def _unassign(self, g: _Group) -> None:
        self._consumed -= 1
        self._staleness[g.step - g.version] -= 1
        g.step = -1

    def _assign(self) -> list[Assigned]:
        """Assign completed groups to step `t`, earliest deadline first, while the invariant
        allows; close steps as they fill."""
        out: list[Assigned] = []
        while not self.finished:
            self._drop_stale_heads()
            if not self._ready:
                break
            d = self._ready[0][0]
            # Taking a group of deadline d lowers cap(s) by one for every s >= t but U(<= s)
            # only for s >= d: the steps t .. d-1 need one slot of slack.
            if d > self._t and self._slack_min(0, d - self._t - 1) < 1:
                break
            gid = heapq.heappop(self._ready)[2]
            g = self._groups[gid]
            self._due[d - self._t] -= 1
            self._move(g, GroupState.ASSIGNED)
            g.step = self._t
            self._record_assignment(g)
            self._consumed += 1
            self._staleness[self._t - g.version] += 1
            out.append(Assigned(gid, self._t, g.version))
            self._f -= 1
            if self._f == 0:
                if self._due[0]:
                    raise SchedulingError(f"step {self._t} closed with deadline groups left")
                self._t += 1
                self._f = self._b
                self._due.pop(0)
                self._due.append(0)
        return out
