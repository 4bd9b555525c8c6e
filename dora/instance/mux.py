"""`MuxConnection`: a client's one long-lived multiplexed connection to an instance's `/v1/mux`.

Each generate call goes out as one binary WebSocket frame `[CALL, id, body]` and its answer comes
back as `[id, status, body]`, matched by id (dora/instance/mux_server.py has the protocol). The
connection is opened by the first call and kept; one reader task owns its incoming frames and
lives as long as the connection (closed with the client).

Failures keep the HTTP client's meaning, so the caller's retry policy applies unchanged: a
connection that cannot be opened or drops fails every call in flight on it as
`ServerUnavailable` (the next call connects again); a call past its deadline is `ServerTimeout`;
a connection refused for its token (401, 403) is `RequestError`. An upgrade answered with any
other status (a proxy in front of the instance that does not pass WebSockets, or an instance
without the route) is `MuxRefused`: the client then sends its calls over HTTP instead.
A call whose caller gives up (deadline, cancellation) is cancelled on the instance with a
`[CANCEL, id, b""]` frame, as closing an HTTP request aborts it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import aiohttp
import msgspec

from dora.errors import RequestError, ServerTimeout, ServerUnavailable

__all__ = ["MuxConnection", "MuxRefused"]

log = logging.getLogger("dora.instance")

CALL = 0
CANCEL = 1
MAX_FRAME_BYTES = 16 << 20

_answer = msgspec.msgpack.Decoder(tuple[int, int, bytes])
_encode = msgspec.msgpack.Encoder().encode


class MuxRefused(ServerUnavailable):
    """The instance's address answered the upgrade to `/v1/mux` with another status than 101:
    something on the way (or the instance) does not serve the multiplexed connection."""


class MuxConnection:
    """Calls to one instance over one WebSocket, answers matched by id."""

    def __init__(self, url: str, *, headers: dict[str, str]) -> None:
        self.url = url
        self.headers = headers
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._ids = itertools.count()
        self._cancels: set[asyncio.Task[None]] = set()
        self.connects = 0
        """Connections opened (the first one and each reconnection after a drop)."""

    async def call(
        self, session: aiohttp.ClientSession, body: bytes, *, timeout_s: float, what: str
    ) -> tuple[int, bytes]:
        """Send one call and wait for its answer: (status, body)."""
        call_id = next(self._ids)
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        ws: aiohttp.ClientWebSocketResponse | None = None
        try:
            async with asyncio.timeout(timeout_s):
                ws = await self._connected(session)
                self._pending[call_id] = future
                await ws.send_bytes(_encode((CALL, call_id, body)))
                return await future
        except TimeoutError as exc:
            raise ServerTimeout(
                f"{what}: no answer from {self.url} within {timeout_s:g} s"
            ) from exc
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (401, 403):  # the run's token is missing or wrong: retrying won't help
                raise RequestError(f"{what}: {self.url} refused the connection: {exc}") from exc
            raise MuxRefused(f"{what}: {self.url} refused the connection: {exc}") from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise ServerUnavailable(f"{what}: {self.url} unreachable: {exc}") from exc
        finally:
            if self._pending.pop(call_id, None) is not None and ws is not None and not ws.closed:
                self._cancel(ws, call_id)  # its caller gave up: stop it on the instance too

    async def _connected(self, session: aiohttp.ClientSession) -> aiohttp.ClientWebSocketResponse:
        async with self._connecting:
            if self._ws is None or self._ws.closed:
                ws = await session.ws_connect(
                    self.url, headers=self.headers, max_msg_size=MAX_FRAME_BYTES, autoping=True
                )
                self._ws = ws
                self.connects += 1
                self._reader = asyncio.get_running_loop().create_task(self._read(ws))
            return self._ws

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Hand each answer to its call until the connection ends; then fail the calls left."""
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    break
                try:
                    call_id, status, body = _answer.decode(msg.data)
                except msgspec.DecodeError:
                    log.warning("%s sent a frame that does not decode; closing", self.url)
                    break
                future = self._pending.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_result((status, body))
        finally:
            with contextlib.suppress(aiohttp.ClientError, ConnectionError):
                await ws.close()
            failed = [f for f in self._pending.values() if not f.done()]
            self._pending = {k: f for k, f in self._pending.items() if f.done()}
            for future in failed:
                future.set_exception(
                    ServerUnavailable(f"generate: the connection to {self.url} dropped")
                )

    def _cancel(self, ws: aiohttp.ClientWebSocketResponse, call_id: int) -> None:
        task = asyncio.get_running_loop().create_task(self._send_cancel(ws, call_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _send_cancel(self, ws: aiohttp.ClientWebSocketResponse, call_id: int) -> None:
        with contextlib.suppress(aiohttp.ClientError, ConnectionError):
            async with asyncio.timeout(10.0):
                await ws.send_bytes(_encode((CANCEL, call_id, b"")))

    async def close(self) -> None:
        """Close the connection; its calls in flight fail as `ServerUnavailable`."""
        for task in list(self._cancels):
            task.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._ws = self._reader = None
