"""User callables off the event loop, each with a deadline.

An environment's hooks (`reset`, `step`, `reward`, `tools`, `close`, its constructor) and its tools
are the user's code, run inside serve's event loop, which also drives every LLM call, the
instances' health probes and the trainer link. A synchronous hook that blocks (a scorer that
sleeps, a regex that backtracks, a file read) would hold all of that for as long as it runs, so
`OffLoop` runs synchronous callables in worker threads of its own, and `call_hook` runs any hook,
sync or async, under a deadline.

The threads are the runner's own, not the loop's default executor: a synchronous callable that
hangs keeps its thread until it returns (Python cannot kill a thread), and with a shared pool a few
such hangs would starve everything else queued there. `close()` lets the threads go; one still
running is left to finish alone.

A hook's deadline covers the whole call: the thread's work, then awaiting what it returned (a
synchronous method may return a coroutine, e.g. `SingleTurnEnv.reward` returning an async
`score`). An async hook that blocks the loop itself (it calls `time.sleep`) cannot be moved off it;
the loop-stall watchdog (`dora.looplag`) names it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["HookTimeout", "OffLoop", "call_hook"]


class HookTimeout(TimeoutError):
    """A hook ran past its deadline."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"timed out after {timeout_s:g} s")
        self.timeout_s = timeout_s


class OffLoop:
    """Worker threads of one owner (an episode, a toolbox): `await run(fn, *args)` runs `fn` in
    one of them. The threads start on first use; `close()` lets them go."""

    def __init__(self, workers: int = 1, *, name: str = "dora-hook") -> None:
        self.workers = workers
        self.name = name
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., object], *args: object, **kwargs: object) -> object:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
        # The caller's context goes along (as `asyncio.to_thread` does): log fields, tracing.
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        """Let the threads go; one still running keeps only itself alive until it returns."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


async def call_hook(
    threads: OffLoop | None, fn: Callable[..., object], *args: object, timeout_s: float
) -> object:
    """`fn(*args)` within `timeout_s` (`HookTimeout` past it): an `async def` awaited on the loop,
    a synchronous callable in one of `threads` (on the loop when None: the framework's own
    trivial defaults), and an awaitable it returns awaited within the same deadline."""
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            if inspect.iscoroutinefunction(fn) or threads is None:
                result = fn(*args)
            else:
                result = await threads.run(fn, *args)
            if inspect.isawaitable(result):
                result = await result
            return result
    except TimeoutError:
        if deadline.expired():
            raise HookTimeout(timeout_s) from None
        raise  # the hook's own TimeoutError: its failure, not its deadline
