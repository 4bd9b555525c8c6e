"""Loop turns: at most one episode's stretch of work per event-loop iteration.

asyncio runs, in one iteration, every callback that was ready when the iteration began, and only
then looks at its timers and sockets again. Serve's episodes wake in bursts: the answers of many
instances arrive in one read of the sockets, a step's admissions start hundreds of episodes, a
version switch finishes a wave of groups. Each woken episode then runs its Python work (packing
the completion, decoding its text, the reward, the next request) up to its next real wait, and a
burst of fifty such stretches of a few milliseconds holds every other task (timers, health probes,
the trainer link, the next answers) for a large fraction of a second.

`Turns` serialises those stretches: `await turns.take()` queues the caller, and each loop
iteration resumes the longest-waiting caller only. The total work is the same and is done in the
order it arrived; what changes is that timers and sockets are looked at between two stretches, so
the loop's lateness is bounded by one stretch instead of a burst. Serve takes a turn before each
call to an instance, after each answer, and before a finished group is packed and journaled.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Turns"]


class Turns:
    """A first-come, first-served queue of callers, one resumed per event-loop iteration.

    Not a lock: a caller holds nothing once resumed, so there is nothing to release and no
    deadlock; a caller cancelled while it waits is skipped.
    """

    def __init__(self) -> None:
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._releasing: asyncio.Handle | None = None
        self.taken = 0
        """Turns handed out so far."""

    def __len__(self) -> int:
        """Callers waiting for their turn now (cancelled ones included until skipped)."""
        return len(self._waiting)

    async def take(self) -> None:
        """Wait for this caller's turn: the next loop iteration in which no earlier caller is
        resumed. Always yields to the loop at least once."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiting.append(future)
        if self._releasing is None:
            self._releasing = loop.call_soon(self._release, loop)
        await future

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:
        # A future's result wakes its task in the next iteration; so does this callback's next
        # run, queued after that wake-up: one caller per iteration.
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
                self.taken += 1
                break
        self._releasing = loop.call_soon(self._release, loop) if self._waiting else None
