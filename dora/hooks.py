"""User callables off the event loop, each with a deadline.

An environment's hooks (`reset`, `step`, `reward`, `tools`, `close`, its constructor) and its tools
are the user's code, run inside serve's event loop, which also drives every LLM call, the
instances' health probes and the trainer link. A synchronous hook that blocks (a scorer that
sleeps, a regex that backtracks, a file read) would hold all of that for as long as it runs, so
`OffLoop` runs synchronous callables in worker threads, and `call_hook` runs any hook,
sync or async, under a deadline.

The threads are dora's own, not the loop's default executor: a synchronous callable that hangs
keeps its thread until it returns (Python cannot kill a thread), and with a shared pool of fixed
size a few such hangs would starve everything else queued there. Here each call is lent a thread
of its own for as long as it runs: an idle one kept from an earlier call, or a new one. A thread
whose call ended goes back to the idle ones (at most `IDLE_KEPT` are kept); one still running
when its caller stopped waiting (a deadline) is left to finish alone and is never lent again. So
the threads alive are about the calls running at once, not the episodes in flight: thousands of
episodes waiting on the model hold none, and starting a thread, which waits until the new thread
first holds the interpreter lock (tens of milliseconds of serve's loop under load), happens only
when more calls run at once than ever before. Consecutive hooks of one episode may run in
different threads: keep nothing an episode needs in `threading.local`.

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
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["IDLE_KEPT", "HookTimeout", "OffLoop", "call_hook"]

IDLE_KEPT = 256
"""Idle threads kept for later calls, of each name."""

_idle: dict[str, list[ThreadPoolExecutor]] = {}
_idle_lock = threading.Lock()


class HookTimeout(TimeoutError):
    """A hook ran past its deadline."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"timed out after {timeout_s:g} s")
        self.timeout_s = timeout_s


class OffLoop:
    """Synchronous calls of one owner (an episode, a toolbox) off the loop, at most `workers` at
    once: `await run(fn, *args)` runs `fn` in a thread lent for that call (module docstring)."""

    def __init__(self, workers: int = 1, *, name: str = "dora-hook") -> None:
        self.workers = workers
        self.name = name
        self._slots = asyncio.Semaphore(workers)

    async def run(self, fn: Callable[..., object], *args: object, **kwargs: object) -> object:
        # The caller's context goes along (as `asyncio.to_thread` does): log fields, tracing.
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        async with self._slots:
            executor = _lend(self.name)
            submitted = executor.submit(call)
            try:
                return await asyncio.wrap_future(submitted)
            finally:
                _give_back(executor, self.name, idle=submitted.done())


def _lend(name: str) -> ThreadPoolExecutor:
    """An idle thread of `name` (a one-thread executor), or a new one."""
    with _idle_lock:
        kept = _idle.get(name)
        if kept:
            return kept.pop()
    return ThreadPoolExecutor(1, thread_name_prefix=name)


def _give_back(executor: ThreadPoolExecutor, name: str, *, idle: bool) -> None:
    """Keep an `idle` thread for a later call (up to `IDLE_KEPT`); let any other one go."""
    if idle:
        with _idle_lock:
            kept = _idle.setdefault(name, [])
            if len(kept) < IDLE_KEPT:
                kept.append(executor)
                return
    executor.shutdown(wait=False, cancel_futures=True)


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
