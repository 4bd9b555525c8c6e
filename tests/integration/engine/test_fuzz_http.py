"""A fuzz test of the engine's HTTP API (hypothesis, bounded, loopback only): whatever body,
content type or route a client sends, the answer is never a 5xx and its body is always strict
JSON (an event stream of JSON events for `stream: true`), so no client ever meets NaN, a crash
page or a half-written answer.

Bodies mix the fields each route knows (with values of the right type, the wrong type and out
of bounds), unknown fields, chat messages of every shape, and raw bytes. Sampling is kept short
(`max_tokens` <= 8, `n` <= 4) so a generated request never runs long. The server runs in its
own thread with its own event loop; the test talks to it with `http.client` over 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import http.client
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dora.engine import EngineServer
from dora.engine.batcher import BatcherConfig

pytestmark = pytest.mark.timeout(300)

Json = dict[str, object]


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[tuple[str, int]]:
    """(host, port) of an engine serving in a thread of its own until the module ends."""
    box: dict[str, object] = {}
    ready = threading.Event()

    async def serve() -> None:
        stop = asyncio.Event()
        async with EngineServer.start(
            tiny_model, threads=1, config=BatcherConfig(max_running=16), body_timeout_s=5.0
        ) as srv:
            box.update(url=srv.url, loop=asyncio.get_running_loop(), stop=stop)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(120), "the engine did not start"
    parts = urlsplit(str(box["url"]))
    assert parts.hostname == "127.0.0.1" and parts.port is not None
    try:
        yield parts.hostname, parts.port
    finally:
        loop = box["loop"]
        assert isinstance(loop, asyncio.AbstractEventLoop)
        loop.call_soon_threadsafe(box["stop"].set)  # type: ignore[attr-defined]
        thread.join(60)


def post(
    engine: tuple[str, int], path: str, body: bytes, content_type: str
) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection(*engine, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type") or ""
    finally:
        conn.close()


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-5, max_value=200), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
token_ids = st.lists(st.integers(min_value=-3, max_value=300), min_size=0, max_size=12)
small_int = st.integers(min_value=-3, max_value=8)
VALID = {
    "max_tokens": st.integers(min_value=1, max_value=8),
    "min_tokens": st.integers(min_value=0, max_value=4),
    "n": st.integers(min_value=1, max_value=4),
    "temperature": st.one_of(st.just(0.0), st.floats(min_value=1e-4, max_value=5)),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=50),
    "seed": st.integers(min_value=0, max_value=2**63 - 1),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=100), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "version": st.just(0),
    "return_token_ids": st.booleans(),
}
"""Values every field accepts: most requests must get past validation to exercise sampling."""
INVALID = {
    **{k: junk for k in VALID},
    "temperature": st.one_of(st.just(1e-45), st.floats(max_value=-1e-9), junk),
    "top_k": st.one_of(st.integers(max_value=-2), junk),
    "seed": st.one_of(st.integers(min_value=2**63, max_value=2**80), st.just(-1), junk),
    "stop_token_ids": st.one_of(st.lists(st.integers(min_value=10**6), min_size=1), junk),
    "n": st.one_of(st.integers(max_value=0), junk),
    "version": st.one_of(st.integers(min_value=1, max_value=3), junk),
    "max_token": junk,  # unknown
    "presence_penalty": junk,  # unsupported
}
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "audio", "text"]), "x": junk}),
    junk,
)
good_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.one_of(
            st.text(min_size=1, max_size=16),
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
                min_size=1,
                max_size=2,
            ),
        ),
    }
)
bad_message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.one_of(st.text(max_size=6), junk), "content": st.one_of(st.lists(part), junk)}
    ),
    junk,
)


@st.composite
def fields(draw: st.DrawFn, *, exclude: tuple[str, ...] = ()) -> tuple[Json, bool]:
    """Sampling fields, all valid or (the flag False) with at least one invalid one."""
    names = [k for k in sorted(VALID) if k not in exclude]
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=6))
    body: Json = {k: draw(VALID[k]) for k in chosen}
    valid = draw(st.booleans())
    if not valid:
        bad = draw(st.sampled_from(sorted(k for k in INVALID if k not in exclude)))
        body[bad] = draw(INVALID[bad])
    return body, valid


@st.composite
def completion_body(draw: st.DrawFn) -> Json:
    body, valid = draw(fields())
    good_prompt = st.one_of(
        st.lists(st.integers(min_value=0, max_value=100), min_size=1, max_size=12),
        st.text(min_size=1, max_size=24),
    )
    body["prompt"] = draw(good_prompt if valid else st.one_of(good_prompt, token_ids, junk))
    body["max_tokens"] = body.get("max_tokens", 4)
    return body


@st.composite
def chat_body(draw: st.DrawFn) -> Json:
    body, valid = draw(fields(exclude=("max_tokens",)))
    good = st.lists(good_message, min_size=1, max_size=3)
    body["messages"] = draw(good if valid else st.one_of(good, st.lists(bad_message), junk))
    body["max_completion_tokens"] = draw(st.integers(min_value=1, max_value=8))
    return body


request = st.one_of(
    st.tuples(st.just("/v1/completions"), completion_body()),
    st.tuples(st.just("/v1/chat/completions"), chat_body()),
    st.tuples(
        st.sampled_from(["/control/abort", "/control/export"]),
        st.dictionaries(st.sampled_from(["request_id", "x"]), junk, max_size=2),
    ),
)


def _strict_json(raw: bytes, content_type: str) -> None:
    """The body decodes as strict JSON (msgspec refuses NaN and Infinity)."""
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", raw[-200:]
        for event in events[:-1]:
            msgspec.json.decode(event)
    else:
        msgspec.json.decode(raw)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@example(  # the two that were a body of NaN and a 500 before
    request=("/v1/completions", {"prompt": [8, 79, 8, 87], "max_tokens": 4, "temperature": 1e-45}),
    encoded=True,
    raw=b"",
)
@example(request=("/v1/completions", {}), encoded=False, raw=b"[" * 100_000)
@given(
    request=request,
    encoded=st.sampled_from([True] * 9 + [False]),
    raw=st.binary(max_size=64),
)
def test_no_request_gets_a_5xx_or_a_body_that_is_not_json(
    engine: tuple[str, int], request: tuple[str, Json], encoded: bool, raw: bytes
) -> None:
    path, body = request
    data = msgspec.json.encode(body) if encoded else raw
    status, answer, content_type = post(engine, path, data, "application/json")
    assert status < 500, (path, body if encoded else raw, status, answer[:300])
    _strict_json(answer, content_type)
