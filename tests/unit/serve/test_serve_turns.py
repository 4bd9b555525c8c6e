"""Loop turns: serve's episodes wake in bursts (many answers in one read of the sockets), and
each runs its Python work before the loop looks at its timers again. Taking turns, one stretch
runs per loop iteration, so a timer (a health probe, the trainer link, the metrics tick) waits for
one stretch, not for the whole burst."""

from __future__ import annotations

import asyncio
import time

from dora.protocol import Completion, SamplingParams
from dora.serve.router import Router
from dora.serve.turns import Turns

BURST = 10
STRETCH_S = 0.005
"""A stretch of work after an answer (packing it, decoding its text, the reward): 5 ms."""


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Iterations:
    """Counts event-loop iterations: a callback that queues itself again runs once in each."""

    def __init__(self) -> None:
        self.count = 0
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._handle.cancel()


async def test_waiters_resume_one_per_loop_iteration_in_the_order_they_came() -> None:
    turns = Turns()
    iterations = Iterations()
    resumed: list[tuple[int, int]] = []

    async def waiter(i: int) -> None:
        await turns.take()
        resumed.append((i, iterations.count))

    await asyncio.gather(*(waiter(i) for i in range(BURST)))
    iterations.stop()
    assert [i for i, _ in resumed] == list(range(BURST))
    seen = [n for _, n in resumed]
    assert len(set(seen)) == BURST, f"several waiters resumed in one iteration: {seen}"
    assert turns.taken == BURST and len(turns) == 0


async def test_a_cancelled_waiter_does_not_hold_up_the_ones_behind_it() -> None:
    turns = Turns()
    first = asyncio.ensure_future(turns.take())
    second = asyncio.ensure_future(turns.take())
    await asyncio.sleep(0)
    first.cancel()
    async with asyncio.timeout(1):
        await second
    assert first.cancelled() and turns.taken == 1


class Answers:
    """An instance whose every call waits for one event, so all answers arrive together."""

    def __init__(self, calls: int) -> None:
        self.arrive = asyncio.Event()
        self.all_called = asyncio.Event()
        self.calls, self.waiting = calls, 0

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, version: int | None
    ) -> Completion:
        self.waiting += 1
        if self.waiting == self.calls:
            self.all_called.set()
        await self.arrive.wait()
        return Completion(
            request_id=request_id,
            token_ids=[1, 2, 3],
            logprobs=[-0.5] * 3,
            versions=[0] * 3,
            finish_reason="stop",
        )


async def test_a_burst_of_answers_leaves_the_loop_free_for_a_timer_between_episodes() -> None:
    router = Router(kv_migration=True)
    instance = Answers(BURST)
    router.add_instance("i0", instance)  # type: ignore[arg-type]
    order: list[object] = []

    async def episode(i: int) -> None:
        router.open(f"e{i}", version=0, instance="i0")
        await router.sampler(f"e{i}").generate([7, 8], SamplingParams(max_tokens=8))
        busy(STRETCH_S)  # what the episode does with its answer, before it next waits
        order.append(i)

    episodes = [asyncio.ensure_future(episode(i)) for i in range(BURST)]
    await instance.all_called.wait()
    asyncio.get_running_loop().call_later(0.001, order.append, "timer")
    instance.arrive.set()  # every answer wakes its episode in the same loop iteration
    await asyncio.gather(*episodes)
    # Without turns the timer, due 1 ms later, fired only after all ten 5-ms stretches.
    assert order.index("timer") <= 2, order
