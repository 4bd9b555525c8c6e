"""The router against fake instances: moves while a call is in flight (abort and resubmit, or KV
export and import), park and resume on a newer version (partial), and an interrupt that misses."""

from __future__ import annotations

import asyncio
import gc

import pytest

from dora.errors import RequestError, ServerUnavailable
from dora.instance import ExportedRequest
from dora.protocol import Completion, SamplingParams
from dora.serve.router import Router

pytestmark = pytest.mark.timeout(10)


class FakeInstance:
    """Samples `first` tokens, then blocks until released (finishes) or aborted/exported (tokens so
    far). Token values encode the position, so continuity across instances can be checked."""

    def __init__(self, name: str, version: int, *, first: int = 3, rest: int = 2) -> None:
        self.name, self.version, self.first, self.rest = name, version, first, rest
        self.calls: list[tuple[str, list[int], int]] = []
        self.imports: list[ExportedRequest] = []
        self.blocked = asyncio.Event()
        self.release = asyncio.Event()
        self._stop: dict[str, asyncio.Event] = {}
        self._params: dict[str, SamplingParams] = {}
        self._prompts: dict[str, list[int]] = {}
        self.prompt_items: list[int] = []  # of each call's prompt, that the collector walks

    def _tokens(self, prompt: list[int], n: int) -> list[int]:
        return [len(prompt) + i for i in range(n)]

    def _completion(self, rid: str, tokens: list[int], finish: str) -> Completion:
        return Completion(
            request_id=rid,
            token_ids=tokens,
            logprobs=[-0.5] * len(tokens),
            versions=[self.version] * len(tokens),
            finish_reason=finish,  # type: ignore[arg-type]
        )

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, version: int | None
    ) -> Completion:
        assert version == self.version, "routed to an instance of another version"
        self.calls.append((request_id, list(prompt_ids), params.max_tokens))
        self.prompt_items.append(len(gc.get_referents(prompt_ids)) - 1)
        stop = self._stop[request_id] = asyncio.Event()
        self._prompts[request_id], self._params[request_id] = list(prompt_ids), params
        self.blocked.set()
        release = asyncio.ensure_future(self.release.wait())
        aborted = asyncio.ensure_future(stop.wait())
        await asyncio.wait([release, aborted], return_when=asyncio.FIRST_COMPLETED)
        release.cancel()
        aborted.cancel()
        if stop.is_set():
            return self._completion(request_id, self._tokens(prompt_ids, self.first), "abort")
        n = min(self.first + self.rest, params.max_tokens)
        return self._completion(request_id, self._tokens(prompt_ids, n), "stop")

    async def abort(self, request_id: str) -> Completion:
        stop = self._stop.get(request_id)
        if stop is None or self.release.is_set():
            raise RequestError(f"abort: HTTP 404: unknown request_id {request_id!r}")
        stop.set()
        return self._completion(request_id, [], "abort")

    async def export_request(self, request_id: str) -> ExportedRequest:
        await self.abort(request_id)
        prompt = self._prompts[request_id]
        tokens = self._tokens(prompt, self.first)
        return ExportedRequest(
            request_id=request_id,
            version=self.version,
            prompt_ids=prompt,
            token_ids=tokens,
            logprobs=[-0.5] * len(tokens),
            versions=[self.version] * len(tokens),
            params=self._params[request_id],
            key=7,
            kv=b"kv",
        )

    async def import_request(self, exported: ExportedRequest) -> Completion:
        self.imports.append(exported)
        await self.release.wait()
        more = [len(exported.prompt_ids) + len(exported.token_ids) + i for i in range(self.rest)]
        tokens = [*exported.token_ids, *more]
        return Completion(
            request_id=exported.request_id,
            token_ids=tokens,
            logprobs=[*exported.logprobs, *([-0.25] * len(more))],
            versions=[*exported.versions, *([self.version] * len(more))],
            finish_reason="stop",
        )

    async def load_weights(self, version: int, **_: object) -> dict[str, object]:
        self.version = version
        return {}

    async def health(self, *, timeout_s: float = 5.0) -> dict[str, object]:
        return {"status": "ok"}

    async def close(self) -> None:
        pass


PROMPT = [1, 2, 3, 4]
PARAMS = SamplingParams(max_tokens=10)


def _router(kv: bool, **instances: FakeInstance) -> Router:
    router = Router(kv_migration=kv, control_timeout_s=5)
    for name, inst in instances.items():
        router.add_instance(name, inst)
    return router


async def test_move_in_flight_resubmits_tokens_so_far() -> None:
    a, b = FakeInstance("a", 0), FakeInstance("b", 0, first=0, rest=2)
    b.release.set()
    router = _router(False, a=a, b=b)
    router.open("g0/0", version=0, instance="a")
    call = asyncio.ensure_future(router.sampler("g0/0").generate(PROMPT, PARAMS))
    await a.blocked.wait()
    assert router.versions_serving() == {0: 1}
    assert router.move("g0/0", "b")
    await router.interrupt("g0/0", export=True)  # kv off: a plain abort
    done = await call
    assert done.finish_reason == "stop"
    assert list(done.token_ids) == list(range(4, 4 + 5)), "the tokens continue where a stopped"
    assert list(done.versions) == [0] * 5
    (_, prompt, max_tokens) = b.calls[0]
    assert prompt == [*PROMPT, 4, 5, 6] and max_tokens == 10 - 3
    # a call in flight holds its prompt as a typed array: no item of it for the collector to walk
    assert a.prompt_items == b.prompt_items == [0]
    assert (
        router.stats.resubmissions == 1
        and router.stats.migrations == 1
        and router.stats.kv_migrations == 0
    )
    assert router.instances["a"].inflight == router.instances["b"].inflight == 0


async def test_move_in_flight_with_kv_imports_the_request() -> None:
    a, b = FakeInstance("a", 0), FakeInstance("b", 0)
    b.release.set()
    router = _router(True, a=a, b=b)
    router.open("g0/0", version=0, instance="a")
    call = asyncio.ensure_future(router.sampler("g0/0").generate(PROMPT, PARAMS))
    await a.blocked.wait()
    assert router.move("g0/0", "b")
    await router.interrupt("g0/0", export=True)
    done = await call
    assert list(done.token_ids) == [4, 5, 6, 7, 8] and done.finish_reason == "stop"
    assert list(done.logprobs) == [-0.5, -0.5, -0.5, -0.25, -0.25]
    assert len(b.imports) == 1 and b.imports[0].token_ids == [4, 5, 6] and not b.calls
    assert router.stats.kv_migrations == 1 and router.stats.resubmissions == 0


async def test_a_plan_moving_many_requests_interrupts_a_few_at_a_time() -> None:
    class Counting(FakeInstance):
        running = peak = 0

        async def export_request(self, request_id: str) -> ExportedRequest:
            Counting.running += 1
            Counting.peak = max(Counting.peak, Counting.running)
            await asyncio.sleep(0.005)
            Counting.running -= 1
            return await super().export_request(request_id)

    a, b = Counting("a", 0), FakeInstance("b", 0)
    b.release.set()
    router = Router(kv_migration=True, control_timeout_s=5, max_interrupts=3)
    router.add_instance("a", a)
    router.add_instance("b", b)
    leases = [f"g0/{i}" for i in range(10)]
    calls = []
    for lid in leases:
        router.open(lid, version=0, instance="a")
        calls.append(asyncio.ensure_future(router.sampler(lid).generate(PROMPT, PARAMS)))
    for _ in range(100):  # every call reaches `a` within a few passes of the loop
        if len(a.calls) == len(leases):
            break
        await asyncio.sleep(0)
    assert len(a.calls) == len(leases)
    assert all(router.move(lid, "b") for lid in leases)
    await asyncio.gather(*(router.interrupt(lid, export=True) for lid in leases))
    done = await asyncio.gather(*calls)
    assert Counting.peak == 3, "no more than max_interrupts exports at once"
    assert all(d.finish_reason == "stop" for d in done) and len(b.imports) == len(leases)


async def _parked(a: FakeInstance, b: FakeInstance) -> tuple[Router, asyncio.Future[Completion]]:
    """A call of lease g0/0 that started on `a` and was parked (`b` answers at once)."""
    b.release.set()
    router = _router(False, a=a, b=b)
    router.open("g0/0", version=0, instance="a")
    call = asyncio.ensure_future(router.sampler("g0/0").generate(PROMPT, PARAMS))
    await a.blocked.wait()
    assert router.park("g0/0")
    await router.interrupt("g0/0", export=False)
    await asyncio.sleep(0.01)
    assert not call.done(), "a parked request waits for its resume"
    return router, call


async def test_park_then_resume_on_a_newer_version_records_token_versions() -> None:
    router, call = await _parked(FakeInstance("a", 0), FakeInstance("b", 1, first=0, rest=2))
    router.resume("g0/0", "b", 1)
    done = await call
    assert list(done.versions) == [0, 0, 0, 1, 1]
    assert router.leases["g0/0"].version == 1


async def test_a_lease_parked_again_before_its_call_wakes_waits_for_the_next_resume() -> None:
    """Partial mode: a resume wakes the parked call, and a newer version parks the lease again
    before that call has run (both in one pass of the loop). The call waits for the resume that
    follows, on the instance it names, instead of finding no instance."""
    a, b = FakeInstance("a", 0), FakeInstance("b", 2, first=0, rest=2)
    router, call = await _parked(a, b)
    router.resume("g0/0", "a", 0)
    assert not router.park("g0/0"), "no call in flight to interrupt"
    await asyncio.sleep(0.01)
    assert not call.done(), "parked again: it waits"
    router.resume("g0/0", "b", 2)
    done = await call
    assert list(done.versions) == [0, 0, 0, 2, 2]
    assert len(a.calls) == 1 and len(b.calls) == 1


async def test_interrupt_that_misses_does_not_hang() -> None:
    a, b = FakeInstance("a", 0), FakeInstance("b", 0)
    router = _router(False, a=a, b=b)
    router.open("g0/0", version=0, instance="a")
    call = asyncio.ensure_future(router.sampler("g0/0").generate(PROMPT, PARAMS))
    await a.blocked.wait()
    assert router.move("g0/0", "b")
    a.release.set()  # the call ends before the interrupt reaches the instance
    await asyncio.sleep(0.01)
    await router.interrupt("g0/0", export=False)
    done = await call
    assert done.finish_reason == "stop" and len(done.token_ids) == 5
    assert router.stats.missed_interrupts == 1 and not b.calls
    # the next turn goes to the lease's new instance
    b.release.set()
    await router.sampler("g0/0").generate(PROMPT, PARAMS)
    assert len(b.calls) == 1


async def test_wait_idle_and_versions_serving() -> None:
    a, b = FakeInstance("a", 0), FakeInstance("b", 1)
    router = _router(False, a=a, b=b)
    router.open("x/0", version=0, instance="a")
    router.open("y/0", version=1, instance="b")
    calls = [
        asyncio.ensure_future(router.sampler(lid).generate(PROMPT, PARAMS))
        for lid in ("x/0", "y/0")
    ]
    await a.blocked.wait()
    await b.blocked.wait()
    assert router.versions_serving() == {0: 1, 1: 1} and router.stats.max_versions_serving == 2
    idle = asyncio.ensure_future(router.wait_idle("a"))
    await asyncio.sleep(0.01)
    assert not idle.done()
    a.release.set()
    b.release.set()
    await asyncio.gather(*calls)
    await idle
    assert router.instances["a"].busy_s > 0 and router.instances["a"].tokens == 5


async def test_an_instance_answered_at_is_when_its_last_call_returned_not_when_one_failed() -> None:
    """What the health watch reads to skip a probe: set by an answer, never by a failure."""
    a, dead = FakeInstance("a", 0, first=0, rest=2), DeadInstance("d", 0)
    a.release.set()
    router = _router(False, a=a, d=dead)
    assert router.answered_at("a") == router.answered_at("d") == float("-inf")
    assert router.answered_at("nobody") == float("-inf")
    router.open("x/0", version=0, instance="a")
    before = asyncio.get_running_loop().time()
    await router.sampler("x/0").generate(PROMPT, PARAMS)
    assert before <= router.answered_at("a") <= asyncio.get_running_loop().time()
    router.open("y/0", version=0, instance="d")
    with pytest.raises(ServerUnavailable):
        await router.sampler("y/0").generate(PROMPT, PARAMS)
    assert router.answered_at("d") == float("-inf")


async def test_wait_idle_does_not_return_when_a_call_began_before_it_woke() -> None:
    """The last call ends (the instance is idle) and another begins in the same pass of the
    loop, before the waiter runs: the instance is busy again, so the waiter goes on waiting."""
    router = _router(False, a=FakeInstance("a", 0))
    inst = router.instances["a"]
    router._begin(inst, 0)
    idle = asyncio.ensure_future(router.wait_idle("a"))
    await asyncio.sleep(0.01)
    router._end(inst, 0, 0)
    router._begin(inst, 0)
    await asyncio.sleep(0.01)
    assert not idle.done(), "a call is in flight"
    router._end(inst, 0, 0)
    await asyncio.wait_for(idle, 1)


class AdapterInstance(FakeInstance):
    """Holds several versions (LoRA adapters): a call is pinned to any of them."""

    def __init__(self, name: str, versions: set[int]) -> None:
        super().__init__(name, max(versions))
        self.held = versions

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, version: int | None
    ) -> Completion:
        assert version in self.held, "routed to an instance without the lease's version"
        self.version = version  # the fake tags its tokens with the call's version
        return await super().generate(prompt_ids, params, request_id=request_id, version=version)


async def test_one_instance_serves_calls_of_several_lease_versions() -> None:
    a = AdapterInstance("a", {1, 2})
    router = _router(False, a=a)
    router.open("x/0", version=1, instance="a")
    router.open("y/0", version=2, instance="a")
    calls = [
        asyncio.ensure_future(router.sampler(lid).generate(PROMPT, PARAMS))
        for lid in ("x/0", "y/0")
    ]
    await a.blocked.wait()
    await asyncio.sleep(0.01)
    assert len(a.calls) == 2
    # counted per lease version, not per instance: one instance serves two versions
    assert router.versions_serving() == {1: 1, 2: 1} and router.stats.max_versions_serving == 2
    a.release.set()
    await asyncio.gather(*calls)
    assert router.versions_serving() == {} and router.instances["a"].inflight_versions == {}


class DeadInstance(FakeInstance):
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, version: int | None
    ) -> Completion:
        raise ServerUnavailable(f"generate: {self.name} unreachable")


async def test_an_unreachable_instance_is_reported_and_the_call_resubmitted() -> None:
    a, b = DeadInstance("a", 0), FakeInstance("b", 0, first=0, rest=2)
    b.release.set()
    router = _router(False, a=a, b=b)
    router.open("g0/0", version=0, instance="a")
    with pytest.raises(ServerUnavailable):  # without a failure handler, the error propagates
        await router.sampler("g0/0").generate(PROMPT, PARAMS)
    failed: list[str] = []

    def on_failure(instance: str) -> None:
        failed.append(instance)
        router.move("g0/0", "b")  # what the orchestrator's remove_instance decides

    router.on_failure = on_failure
    done = await router.sampler("g0/0").generate(PROMPT, PARAMS)
    assert failed == ["a"] and list(done.token_ids) == [4, 5] and router.stats.failed_calls == 1


async def test_a_cut_instance_ends_its_calls_at_once_and_they_resubmit() -> None:
    """A hung instance (its calls never return) that the rollout declares dead: `cut` ends the
    calls in flight on it like an unreachable instance's, and they continue on a peer."""
    a, b = FakeInstance("a", 0), FakeInstance("b", 0, first=0, rest=2)
    b.release.set()
    router = _router(False, a=a, b=b)
    failed: list[str] = []

    def on_failure(instance: str) -> None:  # what the orchestrator's remove_instance decides
        failed.append(instance)
        for lid, lease in router.leases.items():
            if lease.instance == instance:
                router.move(lid, "b")

    router.on_failure = on_failure
    calls = []
    for lid in ("g0/0", "g0/1"):
        router.open(lid, version=0, instance="a")
        calls.append(asyncio.ensure_future(router.sampler(lid).generate(PROMPT, PARAMS)))
    while len(a.calls) < 2:
        a.blocked.clear()
        await a.blocked.wait()
    assert router.cut("a") == 2
    done = await asyncio.gather(*calls)
    assert [list(d.token_ids) for d in done] == [[4, 5], [4, 5]] and failed == ["a", "a"]
    assert router.stats.failed_calls == 2 and router.instances["a"].inflight == 0
    router.open("g1/0", version=0, instance="a")  # a call placed on it after the cut ends too
    assert list((await router.sampler("g1/0").generate(PROMPT, PARAMS)).token_ids) == [4, 5]
    assert failed == ["a", "a", "a"]


class RefusingInstance(FakeInstance):
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, version: int | None
    ) -> Completion:
        raise RequestError("generate: HTTP 400: prompt does not fit max_model_len")


async def test_a_refused_request_ends_the_episode_with_error() -> None:
    router = _router(False, a=RefusingInstance("a", 0))
    router.open("g0/0", version=0, instance="a")
    done = await router.sampler("g0/0").generate(PROMPT, PARAMS)
    assert done.finish_reason == "error" and list(done.token_ids) == []


async def test_a_pinned_lease_holds_its_instance_until_it_ends_or_leaves() -> None:
    router = Router(kv_migration=False, pin_versions=False)
    router.open("eval1/0", version=3, instance="i0", pinned=True)
    router.open("eval1/1", version=3, instance="i0", pinned=True)
    router.open("g0/0", version=3, instance="i0")  # an ordinary lease holds nothing
    router.open("g1/0", version=3, instance="i1")
    await asyncio.wait_for(router.wait_unpinned("i1"), 1)
    waiting = asyncio.ensure_future(router.wait_unpinned("i0"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    router.close("eval1/0")
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the other one is still there
    router.move("eval1/1", "i1")
    await asyncio.wait_for(waiting, 1)
    assert router.holds_pinned("i1") and not router.holds_pinned("i0")
    router.close("eval1/1")
    assert not router.pinned
