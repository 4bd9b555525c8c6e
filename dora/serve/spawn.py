"""The task group a running serve starts its tasks in (one crash stops the run)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["Spawner"]


class Spawner:
    """Starts tasks in the run's `asyncio.TaskGroup`, once `Rollout.run` has opened it."""

    def __init__(self) -> None:
        self._tg: asyncio.TaskGroup | None = None

    def open(self, tg: asyncio.TaskGroup | None) -> None:
        """Set (or, with None, clear) the task group tasks go to."""
        self._tg = tg

    def __call__(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        """Run `coro` in the run's task group."""
        assert self._tg is not None, "the rollout is not running"
        return self._tg.create_task(coro, name=name)
