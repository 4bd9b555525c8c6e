"""Generate calls over one long-lived multiplexed connection: the server's side of `GET /v1/mux`.

An HTTP request per model call costs serve more CPU than the call's own work once sessions make
its body small (headers built and parsed, a pooled connection taken and given back, a response
object per call). A client instead opens one WebSocket per instance and sends each call as one
binary frame; answers come back as frames matched by id, in whatever order they finish.

Frames are msgpack arrays (`dora.protocol` types, never pickle):
- client to server: `[CALL, id, body]`, `body` the JSON of a `POST /v1/completions` (decoded by
  the same strict schema, sessions included), or `[CANCEL, id, b""]` for a call its caller gave up
  (deadline, cancellation): the server stops it, as it stops an HTTP request whose caller went
  away;
- server to client: `[id, status, body]`: status 200 with the completions answer in msgpack (as
  `wire.answer` sends it to `Accept: application/msgpack`), or an error status with its JSON body
  (`wire.error_body`).

The route is authenticated as the control routes are (the run's bearer token where the server has
one, else loopback callers only). When the connection drops, the server stops every call that was
running on it; the client fails them as `ServerUnavailable` and connects again for the next call
(`dora.instance.mux`). Torch-free: the embedded engine and the emulated instances share it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import WSMsgType, web

__all__ = ["CALL", "CANCEL", "MAX_FRAME_BYTES", "Complete", "serve_mux"]

CALL = 0
CANCEL = 1
MAX_FRAME_BYTES = 16 << 20
"""The largest frame either side accepts (the completions route's body limit)."""

Complete = Callable[[bytes], Awaitable[tuple[int, bytes]]]
"""One call: the JSON body of a completions request in; (status, answer bytes) out."""

_frame = msgspec.msgpack.Decoder(tuple[int, int, bytes])
_encode = msgspec.msgpack.Encoder().encode


async def serve_mux(
    request: web.Request, complete: Complete, denied: web.Response | None
) -> web.StreamResponse:
    """Answer the calls of one connection until it closes; `denied`: the refusal, if any."""
    if denied is not None:
        return denied
    ws = web.WebSocketResponse(max_msg_size=MAX_FRAME_BYTES)
    await ws.prepare(request)
    running: dict[int, asyncio.Task[None]] = {}

    async def one(call_id: int, body: bytes) -> None:
        try:
            status, out = await complete(body)
        finally:
            running.pop(call_id, None)
        if not ws.closed:  # else the client went away: it failed the call on its side
            with contextlib.suppress(ConnectionError):
                await ws.send_bytes(_encode((call_id, status, out)))

    async with asyncio.TaskGroup() as tg:
        try:
            async for msg in ws:
                if msg.type != WSMsgType.BINARY:
                    break
                try:
                    kind, call_id, body = _frame.decode(msg.data)
                except msgspec.DecodeError:
                    await ws.close(code=1003, message=b"frames are msgpack [kind, id, body]")
                    break
                if kind == CALL and call_id not in running:
                    running[call_id] = tg.create_task(one(call_id, body))
                elif kind == CANCEL and call_id in running:
                    running[call_id].cancel()
        finally:
            for task in list(running.values()):  # the connection is gone: so are its calls
                task.cancel()
    return ws
