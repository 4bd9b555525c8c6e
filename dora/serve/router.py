"""The router: every LLM call of an episode goes to an instance holding the episode's version.

An episode (one sample of a group) holds a *lease* from placement to its end: the orchestrator
decides which instance the lease sits on (least loaded instance of the version when the group
starts, sticky across turns), and moves it with `Migrate` (same version, C1), `Park` and `Resume`.
This module carries those decisions out against real instances and gives each episode a `Sampler`
(`LeaseSampler`) that hides them: the episode runner just calls `generate`.

How a move is carried out while a call is in flight: the router interrupts the call on its old
instance (abort, or export with the KV cache when `kv_migration` is on), and the sampler, whose
`generate` on that instance then returns with finish reason "abort", continues on the lease's new
instance: it imports the exported request (no re-prefill), or resubmits the prompt plus the tokens
so far with the remaining token budget. The caller sees one completion whose per-token `versions`
are whatever the engines reported (all equal except in partial mode, where a resumed request
continues on the newest version).

Invariants:
- a call is sent only to an instance the orchestrator marked ready for the lease's version;
- the router's count of calls in flight per instance lets a `Load` wait until the instance is
  really empty (an abort that races with a call's start must not let a load change the weights
  under a running call);
- a move whose interruption missed (the call had already finished) is harmless: the call's result
  stands and the next turn goes to the new instance;
- an instance that becomes unreachable (`ServerUnavailable`) is reported to `on_failure` (the
  rollout removes it from the orchestrator, which migrates or parks its leases); the calls it was
  running are resubmitted with the tokens their episodes had before the call (the lost call's
  tokens are gone with the instance; it is the same version, so C1 holds);
- an instance declared dead without an error (it stopped answering: `cut`) goes the same way:
  every call in flight on it ends at once, as if the instance had been unreachable;
- a request the instance refuses as malformed (`RequestError`, HTTP 4xx) ends its episode with
  finish reason "error" (the runner masks the sample, the group stays whole); any other server
  error propagates and stops the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from dora.errors import RequestError, ServerError, ServerUnavailable
from dora.instance import ExportedRequest, InstanceClient, SetBackground
from dora.protocol import Completion, SamplingParams
from dora.serve.resubmit import complete_calls, generate
from dora.serve.stats import ServeStats
from dora.serve.turns import Turns

__all__ = ["Execute", "InstanceState", "InstanceUsage", "Lease", "LeaseSampler", "Router"]

log = logging.getLogger("dora.serve")


@dataclass(eq=False)
class InstanceState:
    """The router's view of one instance: its client and what is running on it now."""

    id: str
    client: InstanceClient
    inflight: int = 0
    inflight_versions: dict[int, int] = field(default_factory=dict)
    """Calls in flight per lease version (no zero entries)."""
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    busy_s: float = 0.0
    """Seconds with at least one call in flight (utilisation)."""
    busy_since: float | None = None
    tokens: int = 0
    """Tokens sampled by calls that returned from this instance."""
    answered_at: float = float("-inf")
    """Loop time of the last model call it answered (the health watch skips its probe then)."""
    alive: bool = True
    cuts: set[asyncio.Timeout] = field(default_factory=set)
    """One deadline per call in flight; `Router.cut` expires them all."""
    set_background: SetBackground | None = None
    """Moves its model to its idle-policy thread and back, where serve started an engine process
    (`dora.serve.cpu_priority`)."""

    def __post_init__(self) -> None:
        self.idle.set()

    def busy_until(self, now: float) -> float:
        """`busy_s` including the current busy stretch, up to `now`."""
        return self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)


class InstanceUsage(NamedTuple):
    """How much one instance has been used (for the ticks and the summary)."""

    busy_s: float
    """Seconds with at least one call in flight, up to now."""
    inflight: int
    tokens: int


@dataclass(eq=False)
class Lease:
    """One episode's hold on its version, and where it runs."""

    id: str
    version: int
    instance: str | None
    placed: asyncio.Event = field(default_factory=asyncio.Event)
    call_id: str | None = None
    """The engine request id of the call in flight, if any."""
    call_instance: str | None = None
    interrupt: asyncio.Future[ExportedRequest | None] | None = None
    """Set when the router interrupted the call in flight (result: the export, if any)."""
    interrupt_target: tuple[asyncio.Future[ExportedRequest | None], str, str] | None = None
    """(its future, call id, instance): what the pending interrupt must stop."""
    calls: int = 0
    migrations: int = 0
    resumes: int = 0
    failed: str | None = None
    """Why the orchestrator failed the lease (`Fail`): its next call is refused."""
    session_on: str | None = None
    """The instance that holds the episode's session (its context), if any."""


Execute = Callable[[InstanceState, str, int | None, str | None], Awaitable[Completion]]
"""How one call is made on an instance: (instance, call id, pinned version, session) ->
completion."""


MAX_INTERRUPTS = 32
"""Interrupts (aborts, KV exports) in flight at once. A version switch can move hundreds of
requests in one plan; started together, their HTTP calls would all be set up in one event-loop
iteration (at 128 instances, 849 migrations made a 670 ms tick), and every other task would wait
that long. Bounded, they go out a few dozen at a time and other work runs in between."""


class Router:
    """Leases, instances, and the moves between them."""

    def __init__(
        self,
        *,
        kv_migration: bool,
        control_timeout_s: float = 60.0,
        stats: ServeStats | None = None,
        max_interrupts: int = MAX_INTERRUPTS,
        pin_versions: bool = True,
        turns: Turns | None = None,
        sessions: bool = False,
    ) -> None:
        self.kv_migration = kv_migration
        self.sessions = sessions
        """Calls name their lease as a session (`Capabilities.sessions`): a continuing episode
        sends its instance only what is new; the session is released when the lease ends,
        moves, parks or fails."""
        self.pin_versions = pin_versions
        """Calls pin their lease's version; off in mode inflight, where an instance changes
        version under its calls and the engine's per-token versions say which sampled what."""
        self.control_timeout_s = control_timeout_s
        self._interrupting = asyncio.Semaphore(max_interrupts)
        self.instances: dict[str, InstanceState] = {}
        self.leases: dict[str, Lease] = {}
        self.pinned: set[str] = set()
        """Leases that need their version for every token (`open`)."""
        self._pinned_left = asyncio.Event()  # a pinned lease ended or left its instance
        self._serving: dict[int, int] = {}  # calls in flight per version, over every instance
        self.stats = stats if stats is not None else ServeStats()
        """The router's counters (`migrations`, `parks`, `failed_calls`, ...)."""
        self.on_failure: Callable[[str], None] | None = None
        """Called with an instance id when a call finds it unreachable; without it the error
        propagates."""
        self.turns = turns if turns is not None else Turns()
        """Serve's loop turns: an episode takes one before each call and after each answer."""

    def add_instance(
        self,
        instance_id: str,
        client: InstanceClient,
        *,
        set_background: SetBackground | None = None,
    ) -> None:
        """A new instance (which versions it holds is `versions.InstanceVersions`' record)."""
        self.instances[instance_id] = InstanceState(
            instance_id, client, set_background=set_background
        )

    def has(self, instance_id: str) -> bool:
        return instance_id in self.instances

    def client(self, instance_id: str) -> InstanceClient:
        return self.instances[instance_id].client

    def is_alive(self, instance_id: str) -> bool:
        """False once the instance was `cut`."""
        return self.instances[instance_id].alive

    def calls_in_flight(self, instance_id: str) -> int:
        """Calls running on the instance now."""
        return self.instances[instance_id].inflight

    def answered_at(self, instance: str) -> float:
        """Loop time of the last model call `instance` answered (-inf: none yet)."""
        state = self.instances.get(instance)
        return float("-inf") if state is None else state.answered_at

    def clients(self) -> dict[str, InstanceClient]:
        """Every instance's client, by id (the dead ones too)."""
        return {i: s.client for i, s in self.instances.items()}

    def usage(self, now: float) -> dict[str, InstanceUsage]:
        """Every instance's use up to `now` (`time.monotonic()`), by id."""
        return {
            i: InstanceUsage(s.busy_until(now), s.inflight, s.tokens)
            for i, s in self.instances.items()
        }

    def background(self) -> list[tuple[str, SetBackground | None, dict[int, int]]]:
        """The live instances as CPU priority sees them: id, how to set its role, and its calls
        in flight per version."""
        return [
            (s.id, s.set_background, s.inflight_versions)
            for s in self.instances.values()
            if s.alive
        ]

    def cut(self, instance_id: str) -> int:
        """The instance is dead although its calls have not failed (it hangs): end every call in
        flight on it now, as if it had become unreachable. Returns how many were cut."""
        inst = self.instances[instance_id]
        inst.alive = False
        now = asyncio.get_running_loop().time()
        for deadline in inst.cuts:
            deadline.reschedule(now)
        return len(inst.cuts)

    # --- leases ------------------------------------------------------------------------------

    def open(self, lease_id: str, *, version: int, instance: str, pinned: bool = False) -> Lease:
        """A lease on `instance`; `pinned`: its episode needs `version` for every token, so in
        mode inflight its instance loads no newer version while it is there (`wait_unpinned`):
        held-out evaluation."""
        lease = Lease(lease_id, version, instance)
        lease.placed.set()
        self.leases[lease_id] = lease
        if pinned:
            self.pinned.add(lease_id)
        return lease

    def close(self, lease_id: str) -> bool:
        """End a lease; False if it was already gone (closed by a roll-back)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self._release_session(lease)
        if lease_id in self.pinned:
            self.pinned.discard(lease_id)
            self._pinned_left.set()
        return True

    def holds_pinned(self, instance_id: str) -> bool:
        """Whether a pinned lease (`open`) sits on the instance."""
        return any(self.leases[lid].instance == instance_id for lid in self.pinned)

    async def wait_unpinned(self, instance_id: str) -> None:
        """Until no pinned lease sits on the instance (mode inflight, before a load)."""
        while self.holds_pinned(instance_id):
            self._pinned_left.clear()
            await self._pinned_left.wait()

    def _release_session(self, lease: Lease, name: str | None = None) -> None:
        """The lease's session is no longer needed where it is (the episode ended or left);
        `name`: the session's name where it is not the lease's (a runner's run of the episode)."""
        inst = self.instances.get(lease.session_on or "")
        lease.session_on = None
        if inst is not None:
            inst.client.release_session(name or lease.id)

    def sampler(self, lease_id: str) -> LeaseSampler:
        return LeaseSampler(self, lease_id)

    def lease(self, lease_id: str) -> Lease | None:
        """The open lease `lease_id`, if it is open."""
        return self.leases.get(lease_id)

    def episodes_per_version(self) -> dict[int, dict[str, int]]:
        """The leases of each version, by where their episode is: in an LLM call (`calling`),
        between calls (`env`: an env step, a tool, the reward) or `parked`."""
        episodes: dict[int, dict[str, int]] = {}
        for lease in self.leases.values():
            where = "parked" if lease.instance is None else "calling" if lease.call_id else "env"
            counts = episodes.setdefault(lease.version, {"calling": 0, "env": 0, "parked": 0})
            counts[where] += 1
        return dict(sorted(episodes.items()))

    def leases_above(self, version: int) -> list[str]:
        """The leases whose version (the one that samples them now) is newer than `version`."""
        return [lid for lid, lease in self.leases.items() if lease.version > version]

    # --- orchestrator actions (synchronous state changes; RPCs go to `interrupt`) -------------

    def move(self, lease_id: str, dst: str) -> bool:
        """`Migrate`: the lease now sits on `dst` (same version). True if a call must be
        interrupted (then run `interrupt`)."""
        lease = self.leases[lease_id]
        lease.instance = dst
        if lease_id in self.pinned:
            self._pinned_left.set()
        if lease.session_on != dst:
            self._release_session(lease)
        lease.migrations += 1
        self.stats.migrations += 1
        return self._needs_interrupt(lease)

    def park(self, lease_id: str) -> bool:
        """`Park`: the lease has no instance until `resume`. True if a call must be interrupted."""
        lease = self.leases[lease_id]
        lease.instance = None
        if lease_id in self.pinned:
            self._pinned_left.set()
        self._release_session(lease)
        lease.placed.clear()
        self.stats.parks += 1
        return self._needs_interrupt(lease)

    def resume(self, lease_id: str, instance: str, version: int) -> None:
        """`Resume`: continue on `instance`, which holds `version` (a newer one in partial mode)."""
        lease = self.leases[lease_id]
        lease.instance, lease.version = instance, version
        lease.resumes += 1
        lease.placed.set()

    def retag(self, instance: str, version: int) -> None:
        """Mode inflight: `instance` loads `version` under its leases, which sample it from now."""
        for lease in self.leases.values():
            if lease.instance == instance:
                lease.version = version

    def fail(self, lease_id: str, reason: str) -> None:
        """`Fail` (after a `Park`): the lease can run on no instance; its episode's next call is
        refused as `RequestError`, so the episode ends with "error" and its sample is masked."""
        lease = self.leases[lease_id]
        lease.failed = reason
        self._release_session(lease)
        lease.placed.set()

    def _needs_interrupt(self, lease: Lease) -> bool:
        if lease.call_id is None or lease.interrupt is not None:
            return False
        lease.interrupt = asyncio.get_running_loop().create_future()
        lease.interrupt_target = (lease.interrupt, lease.call_id, lease.call_instance or "")
        return True

    async def interrupt(self, lease_id: str, *, export: bool) -> None:
        """Stop the lease's call in flight on its old instance; with `export`, take its KV cache
        along. The call named when the move was decided is the one stopped, even if it returned
        meanwhile. The future always gets a result: the sampler waits on it."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.interrupt_target is None:
            return
        future, call_id, instance_id = lease.interrupt_target
        lease.interrupt_target = None
        result: ExportedRequest | None = None
        try:
            async with self._interrupting:  # the timeout starts once this one may go out
                client = self.instances[instance_id].client
                async with asyncio.timeout(self.control_timeout_s):
                    if export and self.kv_migration:
                        result = await client.export_request(call_id)
                    else:
                        await client.abort(call_id)
        except (ServerError, TimeoutError) as exc:
            # The call had finished (404/409) or the instance is gone: resubmission covers both.
            self.stats.missed_interrupts += 1
            log.debug("interrupting %s on %s: %s", call_id, instance_id, exc)
        finally:
            if not future.done():
                future.set_result(result)

    # --- calls -------------------------------------------------------------------------------

    async def wait_idle(self, instance_id: str) -> None:
        """Until no call is in flight on the instance (before loading other weights)."""
        inst = self.instances[instance_id]
        while inst.inflight:  # a call may begin between the last one's end and this task's turn
            await inst.idle.wait()

    def _begin(self, inst: InstanceState, version: int) -> None:
        if inst.inflight == 0:
            inst.busy_since = time.monotonic()
            inst.idle.clear()
        inst.inflight += 1
        inst.inflight_versions[version] = inst.inflight_versions.get(version, 0) + 1
        self._serving[version] = self._serving.get(version, 0) + 1
        self.stats.max_versions_serving = max(self.stats.max_versions_serving, len(self._serving))

    def _end(self, inst: InstanceState, version: int, tokens: int) -> None:
        inst.inflight -= 1
        left = inst.inflight_versions.pop(version) - 1
        if left:
            inst.inflight_versions[version] = left
        left = self._serving.pop(version) - 1
        if left:
            self._serving[version] = left
        inst.tokens += tokens
        if inst.inflight == 0:
            if inst.busy_since is not None:
                inst.busy_s += time.monotonic() - inst.busy_since
            inst.busy_since = None
            inst.idle.set()

    def versions_serving(self) -> dict[int, int]:
        """Calls in flight per version (the version each call's lease is pinned to), now."""
        return dict(sorted(self._serving.items()))

    def _session(self, inst: InstanceState, lease: Lease) -> str | None:
        """The session the lease's call on `inst` names (None without sessions); a session the
        lease held elsewhere is released first."""
        if not self.sessions:
            return None
        if lease.session_on != inst.id:
            self._release_session(lease)
            lease.session_on = inst.id
        return lease.id

    def restart(self, lease_id: str, *, session: str | None = None) -> None:
        """The lease's episode starts again from its beginning (its runner was lost): the
        context its session held (named `session` by the lost run, if not after the lease) is of
        no use any more."""
        lease = self.leases.get(lease_id)
        if lease is not None:
            self._release_session(lease, session)

    async def call(
        self,
        lease: Lease,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        imported: ExportedRequest | None = None,
    ) -> tuple[Completion, ExportedRequest | None, bool]:
        """One call on the lease's instance: a generate, or the import of an exported request
        (continues without re-prefill; its completion holds the exported tokens too). Returns
        (completion, the export if the router interrupted it with KV, interrupted?)."""

        async def execute(
            inst: InstanceState, call_id: str, version: int | None, session: str | None
        ) -> Completion:
            return await generate(
                inst.client,
                prompt_ids,
                params,
                request_id=call_id,
                version=version,
                session=session,
            )

        return await self.call_with(lease, execute, imported=imported)

    async def call_with(
        self, lease: Lease, execute: Execute, *, imported: ExportedRequest | None = None
    ) -> tuple[Completion, ExportedRequest | None, bool]:
        """`call`, with the generate done by `execute(instance, call id, pinned version,
        session)`: here, or by an episode runner that calls the instance itself
        (`dora.serve.runners`). Every rule of a call (routing, in-flight counts, cuts,
        interrupts, failures) is the same either way."""
        while lease.instance is None:  # parked; a resume may be followed by another park
            await lease.placed.wait()  # before this task runs again, so look once more
            if lease.failed is not None:
                raise RequestError(f"episode {lease.id} can run on no instance: {lease.failed}")
        inst = self.instances[lease.instance]
        lease.calls += 1
        call_id = f"{lease.id}#{lease.calls}"
        lease.call_id, lease.call_instance = call_id, inst.id
        version = lease.version
        self._begin(inst, version)
        completion: Completion | None = None
        future: asyncio.Future[ExportedRequest | None] | None = None
        cut = asyncio.timeout(None if inst.alive else 0)
        try:
            async with cut:
                inst.cuts.add(cut)
                try:
                    if imported is None:
                        pin = version if self.pin_versions else None
                        session = self._session(inst, lease)
                        completion = await execute(inst, call_id, pin, session)
                    else:
                        self.stats.kv_migrations += 1
                        completion = await inst.client.import_request(
                            msgspec.structs.replace(imported, request_id=call_id)
                        )
                finally:
                    inst.cuts.discard(cut)
        except TimeoutError:
            if not cut.expired():
                raise
            if self.on_failure is None:
                raise ServerUnavailable(f"instance {inst.id} was declared dead") from None
        except ServerUnavailable:
            if self.on_failure is None:
                raise
        finally:
            if completion is not None:
                inst.answered_at = asyncio.get_running_loop().time()
            self._end(inst, version, 0 if completion is None else len(completion.token_ids))
            lease.call_id = lease.call_instance = None
            # also when the call raised: a later move must be able to interrupt the next call
            future, lease.interrupt = lease.interrupt, None
        if completion is None:
            # The instance is gone, and the tokens of this call with it. The failure handler
            # moves (or parks) every lease it held; the caller resubmits the tokens it has.
            self.stats.failed_calls += 1
            self.on_failure(inst.id)  # type: ignore[misc]
            lost = Completion(
                request_id=call_id, token_ids=[], logprobs=[], versions=[], finish_reason="abort"
            )
            return lost, None, True
        if future is None:
            return completion, None, False
        # The router interrupted this call; wait for the RPC that did it (bounded by its own
        # deadline in `interrupt`) to learn whether the KV cache came along.
        exported = await future
        return completion, exported, completion.finish_reason == "abort"


class LeaseSampler:
    """The `Sampler` an episode gets: pinned to its lease's version, and hiding moves."""

    def __init__(self, router: Router, lease_id: str) -> None:
        self._router = router
        self._lease_id = lease_id

    @property
    def lease(self) -> Lease:
        return self._router.leases[self._lease_id]

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        lease, router = self.lease, self._router

        async def call_once(
            prompt: Sequence[int], left: SamplingParams, imported: ExportedRequest | None
        ) -> tuple[Completion, ExportedRequest | None, bool]:
            return await router.call(lease, prompt, left, imported=imported)

        return await complete_calls(
            call_once,
            prompt_ids,
            params,
            name=lease.id,
            version=lambda: lease.version,
            turns=router.turns,
            stats=router.stats,
        )
