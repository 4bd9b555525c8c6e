"""Sessions, the client's side: what a continuing episode must send an instance, and what it holds.

A session is one episode's context on one instance, under the session id the caller names (serve
uses the episode's lease id). After each call the instance keeps the call's whole prompt plus the
tokens it sampled; the next call of the episode sends only the ids after those, with the length
they extend (`session_extends`), and the instance puts the two together. The client does not keep
the tokens themselves, only their length and CRC-32: the episode holds them already, and a copy
per live episode would double serve's memory at cluster scale. The CRC tells whether the next
prompt really extends the session (an agent that edits its history does not): if it does not, the
call sends the whole context and the session starts again from it (`replaced`).

An instance that no longer knows the session (it restarted, or the session expired there) answers
so; the client then sends the whole context once more and the session starts again from it
(`unknown`, counted). A call that fails any other way forgets the session on this side, so the
next call sends the whole context: nothing is assumed about what the instance kept.

Released sessions (the episode ended, moved to another instance or failed) are named in the next
generate to the same instance (`release_sessions`), so a release costs no call of its own; an
instance also drops sessions past a deadline or a count (`dora.instance.session_store`), so a
release that never goes out leaks nothing.
"""

from __future__ import annotations

import zlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dora.errors import RequestError
from dora.protocol import as_array

__all__ = [
    "SESSION_COUNTS",
    "UNKNOWN_SESSION",
    "ClientSessions",
    "SessionCounts",
    "SessionPlan",
    "SessionUnknown",
]

UNKNOWN_SESSION = "unknown_session"
"""The error type of the 404 that refuses a call continuing a session the instance lacks."""
MAX_CLIENT_SESSIONS = 65536
"""Sessions one client remembers (length and CRC each: a few dozen bytes); the least recently
used beyond this are forgotten and released."""


class SessionUnknown(RequestError):
    """The instance does not hold the session at the length the call extends (HTTP 404
    `unknown_session`): the client sends the whole context instead."""


@dataclass
class SessionCounts:
    """How serve's calls with a session went (process-wide, read into the run's summary)."""

    delta: int = 0
    """Calls that sent only the ids new since the session's last call."""
    full: int = 0
    """Calls that sent the whole context: a session's first call, or one that starts it again."""
    unknown: int = 0
    """Calls the instance answered with "unknown session" (restarted, expired): sent again whole."""
    replaced: int = 0
    """Calls whose context did not extend the session's (edited history): sent whole, replacing."""

    def summary(self) -> dict[str, float]:
        """The counts as the run's summary names them (`extra`)."""
        return {
            "session_delta_calls": self.delta,
            "session_full_calls": self.full,
            "session_unknown": self.unknown,
            "session_replaced": self.replaced,
        }


SESSION_COUNTS = SessionCounts()
"""The counts of this process: every client adds to them."""


@dataclass(frozen=True)
class SessionPlan:
    """What one call of a session sends: the ids after `extends` tokens the instance holds."""

    session: str
    extends: int
    new_ids: Sequence[int]
    prompt_len: int
    crc: int
    """CRC-32 of the whole prompt (as int32 bytes), continued over the answer's tokens."""


def _crc(ids: array[Any], start: int, end: int, value: int = 0) -> int:
    return zlib.crc32(memoryview(ids)[start:end].cast("B"), value)


class ClientSessions:
    """The sessions one client's instance holds, as (length, CRC) each, and those to release."""

    def __init__(self, *, limit: int = MAX_CLIENT_SESSIONS) -> None:
        self.limit = limit
        self._held: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._released: list[str] = []

    def __len__(self) -> int:
        return len(self._held)

    def plan(self, session: str, prompt_ids: Sequence[int]) -> SessionPlan:
        """The call for `prompt_ids`: only the new ids when they extend what the instance holds,
        else the whole context (counted as `replaced` when the session existed)."""
        ids = as_array("i", prompt_ids)
        held = self._held.pop(session, None)
        if held is not None:
            length, crc = held
            if length <= len(ids) and _crc(ids, 0, length) == crc:
                SESSION_COUNTS.delta += 1
                whole = _crc(ids, length, len(ids), crc)
                return SessionPlan(session, length, ids[length:], len(ids), whole)
            SESSION_COUNTS.replaced += 1
        SESSION_COUNTS.full += 1
        return SessionPlan(session, 0, ids, len(ids), _crc(ids, 0, len(ids)))

    def whole(self, plan: SessionPlan, prompt_ids: Sequence[int]) -> SessionPlan:
        """The same call with the whole context: the instance did not know the session."""
        SESSION_COUNTS.unknown += 1
        return SessionPlan(plan.session, 0, prompt_ids, plan.prompt_len, plan.crc)

    def keep(self, plan: SessionPlan, token_ids: Sequence[int]) -> None:
        """The call answered with `token_ids`: the instance now holds the prompt and them."""
        tokens = as_array("i", token_ids)
        crc = _crc(tokens, 0, len(tokens), plan.crc)
        self._held[plan.session] = (plan.prompt_len + len(tokens), crc)
        while len(self._held) > self.limit:
            self._released.append(self._held.popitem(last=False)[0])

    def release(self, session: str) -> None:
        """The episode is done with this instance: forget the session here, and name it in the
        next call so the instance drops it too."""
        if self._held.pop(session, None) is not None:
            self._released.append(session)

    def take_released(self) -> list[str]:
        """The sessions to release with the next call (and forget them)."""
        out, self._released = self._released, []
        return out
