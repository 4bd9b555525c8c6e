"""`HttpTransport`: one instance's HTTP calls, with deadlines and dora's error mapping.

What every instance client shares, whatever API the server speaks (the embedded engine's, vLLM's
OpenAI server): one `aiohttp` session with kept-alive connections, the bearer token, a deadline on
every call (`asyncio.timeout`), and the mapping of failures onto dora.errors: unreachable ->
ServerUnavailable, deadline -> ServerTimeout, 409 -> VersionMismatch, 404 with the unknown-session
type -> SessionUnknown, 502/503/504 -> ServerUnavailable, other 4xx -> RequestError, other 5xx ->
ServerError; an answer that does not decode -> ProtocolError. The transport does not retry: the
caller owns the retry policy. The clients hold one each (`EngineClient`, `dora.vllm.VllmClient`)
and build their own routes on it.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from typing import TypeVar

import aiohttp
import msgspec

from dora.errors import (
    ProtocolError,
    RequestError,
    ServerError,
    ServerTimeout,
    ServerUnavailable,
    VersionMismatch,
)
from dora.instance.session import UNKNOWN_SESSION, SessionUnknown
from dora.protocol import MSGPACK, encode_json, encode_msgpack

__all__ = ["KEEPALIVE_S", "SERVER_KEEPALIVE_S", "HttpTransport", "json_object", "raise_for"]

Json = dict[str, object]
T = TypeVar("T")

KEEPALIVE_S = 120.0
"""How long a client keeps an idle connection for its next call to the same instance."""
SERVER_KEEPALIVE_S = 300
"""How long the servers dora starts keep an idle connection open: longer than `KEEPALIVE_S`, so
that the client, not the server, closes it. A server that closes first races the client's next
call on that connection, which then fails with "Server disconnected"."""
_STREAM_BYTES = 1 << 20
"""Bodies past this go as a stream rather than one buffer."""


class HttpTransport:
    """HTTP calls to one server at `base_url` (e.g. `http://127.0.0.1:8000`)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        """`session`: the caller's, which it closes; None: one of the transport's own, made at the
        first call and closed by `close`."""
        self.base_url = base_url.rstrip("/")
        self.headers: dict[str, str] = {"Authorization": f"Bearer {token}"} if token else {}
        self._session = session
        self._own_session = session is None

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def call(
        self,
        method: str,
        path: str,
        data: bytes | None,
        content_type: str | None,
        timeout_s: float,
        what: str,
        *,
        accept: str | None = None,
    ) -> tuple[bytes, str]:
        """One HTTP call, asking for the answer in `accept` (an `Accept` header) when given: the
        answer's bytes and content type. An error status raises (see the module docstring);
        `what` names the call in errors."""
        headers = dict(self.headers)
        if content_type:
            headers["Content-Type"] = content_type
        if accept:
            headers["Accept"] = accept
        url = self.base_url + path
        payload = io.BytesIO(data) if data is not None and len(data) > _STREAM_BYTES else data
        try:
            async with asyncio.timeout(timeout_s):
                async with self.session().request(
                    method, url, data=payload, headers=headers
                ) as resp:
                    raw = await resp.read()
                    status = resp.status
                    kind = resp.content_type
        except TimeoutError as exc:
            raise ServerTimeout(f"{what}: no answer from {url} within {timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise ServerUnavailable(f"{what}: {url} unreachable: {exc}") from exc
        if status >= 400:
            raise_for(status, raw, what)
        return raw, kind

    async def post(
        self,
        path: str,
        body: Json | None,
        timeout_s: float,
        what: str,
        *,
        msgpack: bool = False,
        accept: str | None = None,
    ) -> tuple[bytes, str]:
        """POST `body` as JSON (msgpack with `msgpack`; no body for None), asking for the answer
        in `accept`; the answer's bytes and content type."""
        if body is None:
            data, content_type = None, "application/json"
        elif msgpack:
            data, content_type = encode_msgpack(body), MSGPACK
        else:
            data, content_type = encode_json(body), "application/json"
        return await self.call("POST", path, data, content_type, timeout_s, what, accept=accept)

    async def post_json(
        self, path: str, body: Json, timeout_s: float, what: str, *, msgpack: bool = False
    ) -> Json:
        """`post`, the answer a JSON object (else ProtocolError)."""
        raw, _ = await self.post(path, body, timeout_s, what, msgpack=msgpack)
        return self.decode(raw, what, json_object)

    def decode(self, raw: bytes, what: str, decode: Callable[[bytes], T]) -> T:
        """`decode(raw)`, a body that does not decode raising ProtocolError."""
        try:
            return decode(raw)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise ProtocolError(
                f"{what}: {self.base_url} answered with a body that does not decode: {exc} "
                f"({raw[:80]!r})"
            ) from exc

    def session(self) -> aiohttp.ClientSession:
        """The aiohttp session every call of this transport goes through."""
        if self._session is None:
            # No pool limit (aiohttp's default is 100 connections): serve's admission already
            # bounds the calls to an instance (vLLM's max_num_seqs is 256), a capped pool would
            # queue them here, unseen by the instance, while the router counts them as running,
            # and a health probe must never queue behind long calls. Idle connections are kept
            # through a training phase, so the next step's calls do not reconnect. Every call has
            # its own deadline (`call`): no second timer per call.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session


def raise_for(status: int, raw: bytes, what: str) -> None:
    """The error of an answer with error `status` (see the module docstring)."""
    message = _error_message(raw)
    if status == 404 and _error_type(raw) == UNKNOWN_SESSION:
        raise SessionUnknown(f"{what}: {message}")
    if status == 409:
        raise VersionMismatch(f"{what}: {message}")
    if status in (502, 503, 504):
        raise ServerUnavailable(f"{what}: HTTP {status}: {message}")
    if 400 <= status < 500:
        raise RequestError(f"{what}: HTTP {status}: {message}")
    raise ServerError(f"{what}: HTTP {status}: {message}")


def json_object(raw: bytes) -> Json:
    """`raw` decoded as JSON, which must be an object."""
    out = msgspec.json.decode(raw)
    if not isinstance(out, dict):
        raise msgspec.DecodeError(f"expected a JSON object, got {type(out).__name__}")
    return out


def _error_type(raw: bytes) -> str:
    try:
        return str(msgspec.json.decode(raw)["error"]["type"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return ""


def _error_message(raw: bytes) -> str:
    try:
        body = msgspec.json.decode(raw)
        return str(body["error"]["message"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")
