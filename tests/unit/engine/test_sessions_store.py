"""The instance's session store: a session that is not held, or not at the length a call extends,
is refused; sessions expire after their deadline and past the bound, so a lost release leaks
nothing. The client's side: only a prompt that extends the session's tokens sends the new ids."""

from __future__ import annotations

import pytest

from dora.instance.session import ClientSessions
from dora.instance.session_store import SessionStore, UnknownSession


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_session_extends_only_at_its_own_length() -> None:
    store = SessionStore()
    store.keep("s", [1, 2, 3], [4, 5])
    assert list(store.prompt("s", 5, [6])) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(UnknownSession, match="holds 5 tokens"):
        store.prompt("s", 4, [6])
    with pytest.raises(UnknownSession, match="no such session"):
        store.prompt("t", 5, [6])
    assert list(store.prompt("t", 0, [7, 8])) == [7, 8]  # 0 starts a session afresh


def test_sessions_expire_after_their_deadline_and_past_the_bound() -> None:
    clock = Clock()
    store = SessionStore(max_sessions=2, ttl_s=10.0, clock=clock)
    store.keep("a", [1], [2])
    clock.now = 5.0
    store.keep("b", [1], [2])
    clock.now = 6.0
    store.keep("c", [1], [2])  # past the bound: the least recently used goes
    assert "a" not in store and "b" in store and "c" in store
    clock.now = 15.5  # b's deadline passed, c's not
    store.keep("d", [1], [2])
    assert "b" not in store and "c" in store and "d" in store
    assert store.expired == 2
    store.release(["c", "d", "never-held"])
    assert len(store) == 0


def test_session_client_sends_new_ids_only_when_the_prompt_extends_its_tokens() -> None:
    sessions = ClientSessions()
    first = sessions.plan("e", [1, 2, 3])
    assert (first.extends, list(first.new_ids)) == (0, [1, 2, 3])
    sessions.keep(first, [4, 5])
    nxt = sessions.plan("e", [1, 2, 3, 4, 5, 6, 7])
    assert (nxt.extends, list(nxt.new_ids)) == (5, [6, 7])
    sessions.keep(nxt, [8])
    edited = sessions.plan("e", [1, 9, 3, 4, 5, 6, 7, 8, 10])
    assert (edited.extends, len(edited.new_ids)) == (0, 9)
    # a plan whose call failed is not kept: the next call sends the whole context
    again = sessions.plan("e", [1, 9, 3, 4, 5, 6, 7, 8, 10, 11])
    assert again.extends == 0
    sessions.keep(again, [12])
    sessions.release("e")
    assert sessions.take_released() == ["e"] and sessions.take_released() == []
    assert sessions.plan("e", [1, 9]).extends == 0


def test_session_client_forgets_the_least_recently_used_past_its_limit() -> None:
    sessions = ClientSessions(limit=2)
    for name in ("a", "b", "c"):
        sessions.keep(sessions.plan(name, [1, 2]), [3])
    assert len(sessions) == 2 and sessions.take_released() == ["a"]
