"""Sessions, the instance's side: each episode's context kept, so a call sends only what is new.

A generate that names `session_id` continues that session: its `prompt` is the ids after the
first `session_extends` tokens of the session's context, and the instance puts the two together.
`session_extends` 0 (or absent) starts the session from the prompt alone, replacing any context
it had. Once the call finishes, the session holds the call's whole prompt plus what it sampled,
whatever the finish reason (an aborted call's tokens so far are what its answer carries too).

A session the instance does not hold, or one whose length is not `session_extends`, is refused
with 404 `unknown_session` and nothing is sampled: the client sends the whole context again
(`dora.instance.session`). Sessions expire `ttl_s` after their last call and the least recently
used go past `max_sessions`, so a client that never releases one leaks nothing; a call names the
sessions its client released in `release_sessions`.

The ids are kept as int32 arrays (one object each for the garbage collector, 4 bytes a token).
Torch-free: the embedded engine and the emulated instances share it. The engine's prefix cache
(kvcache.py) keeps the KV of the session's context as of any prompt, so a continuing call
prefills only its new ids.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from dora.protocol import as_array, extend_array

__all__ = ["MAX_SESSIONS", "SESSION_TTL_S", "SessionStore", "UnknownSession"]

SESSION_TTL_S = 900.0
"""Seconds a session outlives its last call (longer than any tool call serve waits for)."""
MAX_SESSIONS = 8192
"""Sessions one instance holds at most; the least recently used go first."""


class UnknownSession(LookupError):
    """The call continues a session this instance does not hold at the length the call names."""


class SessionStore:
    """The sessions of one instance, least recently used first."""

    def __init__(
        self,
        *,
        max_sessions: int = MAX_SESSIONS,
        ttl_s: float = SESSION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._held: OrderedDict[str, tuple[array[Any], float]] = OrderedDict()
        self.expired = 0
        """Sessions dropped by the deadline or the bound (not released by their client)."""

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._held

    def prompt(self, session_id: str, extends: int, new_ids: Sequence[int]) -> array[Any]:
        """The call's whole prompt: the session's first `extends` tokens, then `new_ids`.
        `extends` 0 starts the session again. Raises `UnknownSession`."""
        self._expire()
        if not extends:
            return as_array("i", new_ids)
        held = self._held.get(session_id)
        if held is None or len(held[0]) != extends:
            have = "no such session" if held is None else f"it holds {len(held[0])} tokens"
            raise UnknownSession(
                f"session {session_id!r} of {extends} tokens is not held here ({have}): "
                "send the whole context"
            )
        out = array("i", held[0])
        extend_array(out, new_ids)
        return out

    def keep(self, session_id: str, prompt: Sequence[int], token_ids: Sequence[int]) -> None:
        """The call of `session_id` finished: the session holds `prompt` and `token_ids`."""
        ids = array("i", as_array("i", prompt))
        extend_array(ids, token_ids)
        self._held[session_id] = (ids, self._clock())
        self._held.move_to_end(session_id)
        self._expire()

    def release(self, session_ids: Sequence[str]) -> None:
        for session_id in session_ids:
            self._held.pop(session_id, None)

    def _expire(self) -> None:
        oldest = self._clock() - self.ttl_s
        while self._held:
            session_id, (_, used) = next(iter(self._held.items()))
            if used >= oldest and len(self._held) <= self.max_sessions:
                break
            del self._held[session_id]
            self.expired += 1
