"""Time spent inside the scheduling core, measured where `dora serve` calls it.

`CoreClock.wrap(obj)` returns a stand-in for the transfer queue (with its journal writes) or the
orchestrator whose every method call adds its duration to `seconds` and to `by_call` under
`Type.method` (where the time goes, in the run's summary record). The rollout loop talks to the
stand-ins only, so `seconds` is the orchestration overhead of the run (`dora bench cluster` reports
it per step). Attribute reads pass through; a stand-in is never assigned to.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar, cast

__all__ = ["CoreClock"]

T = TypeVar("T")


class CoreClock:
    """Seconds and calls spent in the wrapped objects' methods."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.by_call: dict[str, float] = {}

    def wrap(self, obj: T) -> T:
        return cast(T, _Timed(obj, self))


class _Timed:
    __slots__ = ("_clock", "_methods", "_target")

    def __init__(self, target: object, clock: CoreClock) -> None:
        self._target = target
        self._clock = clock
        self._methods: dict[str, Callable[..., object]] = {}

    def __getattr__(self, name: str) -> object:
        method = self._methods.get(name)
        if method is not None:
            return method
        value = getattr(self._target, name)
        if not callable(value) or isinstance(value, type):
            return value
        clock = self._clock
        fn = value
        key = f"{type(self._target).__name__}.{name}"

        def timed(*args: object, **kwargs: object) -> object:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                clock.seconds += took
                clock.calls += 1
                clock.by_call[key] = clock.by_call.get(key, 0.0) + took

        self._methods[name] = timed
        return timed
