"""`OffLoop`'s threads: each synchronous call is lent a thread for as long as it runs; a thread
whose call ended serves later calls (of any owner) instead of new threads starting, calls at the
same time run in different threads, and a thread still running a call its caller stopped waiting
for is never lent again."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dora.hooks import HookTimeout, OffLoop, call_hook

pytestmark = pytest.mark.timeout(30)


def thread_ident() -> int:
    return threading.get_ident()


def threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(name)]


async def test_threads_are_lent_per_call_and_kept_for_later_calls() -> None:
    owners = [OffLoop(name="test-lend") for _ in range(200)]
    idents = {await owner.run(thread_ident) for owner in owners for _ in range(3)}
    # 600 calls one after another: one thread, started once, off the loop's thread
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert len(threads_named("test-lend")) == 1


async def test_calls_at_the_same_time_run_in_different_threads() -> None:
    barrier = threading.Barrier(3, timeout=5)

    def meet() -> int:
        barrier.wait()  # returns only when three calls run at once
        return threading.get_ident()

    owner = OffLoop(3, name="test-concurrent")
    idents = await asyncio.gather(*(owner.run(meet) for _ in range(3)))
    assert len(set(idents)) == 3


async def test_an_owner_runs_at_most_workers_calls_at_once() -> None:
    running, most = 0, 0
    lock = threading.Lock()

    def count() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        threading.Event().wait(0.02)
        with lock:
            running -= 1

    owner = OffLoop(2, name="test-slots")
    await asyncio.gather(*(owner.run(count) for _ in range(8)))
    assert most == 2


async def test_a_thread_still_running_a_call_is_never_lent_again() -> None:
    release = threading.Event()
    hung = OffLoop(name="test-hung")
    idents: list[int] = []

    def wait_for_release() -> None:
        idents.append(threading.get_ident())
        release.wait(10)

    with pytest.raises(HookTimeout):
        await call_hook(hung, wait_for_release, timeout_s=0.05)
    (hung_ident,) = idents
    assert [t.ident for t in threads_named("test-hung")] == [hung_ident], "still running"
    nxt = OffLoop(name="test-hung")
    assert await nxt.run(thread_ident) != hung_ident
    release.set()
    for _ in range(100):  # the hung call returns, and its thread ends instead of being kept
        if hung_ident not in {t.ident for t in threads_named("test-hung")}:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the thread of the hung call did not end")
    assert {await nxt.run(thread_ident) for _ in range(5)} != {hung_ident}
