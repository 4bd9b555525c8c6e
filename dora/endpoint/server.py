"""The HTTP side of the endpoint: one aiohttp server per event loop, on 127.0.0.1 and a port the
system picks, serving every running episode under a path segment of its own.

An episode's base URL is `http://127.0.0.1:<port>/<token>/v1`, where `token` is 32 random hex
digits: another episode (or another local user) cannot guess it, so no agent can call into an
episode not its own. The routes under it are `POST /chat/completions`, `POST /completions` and
`GET /models`. A call under the token of an episode that has ended is answered 410; an unknown
token 404. When an episode ends, its calls still in flight are cancelled (their engine requests
with them) before its sample is built.

The server starts with the first episode and stops `LINGER_S` seconds after the last one ended
(or when its loop's tasks are cancelled at the end of `asyncio.run`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiohttp import web

from dora.endpoint.requests import BadRequest
from dora.endpoint.session import Session
from dora.tools import JSON

__all__ = ["EndpointServer", "acquire"]

log = logging.getLogger("dora.endpoint")

LINGER_S = 30.0
"""How long the server outlives its last episode (calls after an episode ended still get 410)."""
MAX_BODY_BYTES = 64 << 20
ENDED_KEPT = 65536
"""Tokens of ended episodes remembered (for their 410)."""

_SERVERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EndpointServer] = (
    weakref.WeakKeyDictionary()
)


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return web.json_response(body, status=status)


class EndpointServer:
    """The endpoint of every episode of one event loop (see the module docstring)."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.late_calls = 0
        """Calls that came after their episode ended."""
        self._inflight: dict[str, set[asyncio.Task[object]]] = {}
        self._runner: web.AppRunner | None = None
        self._port = 0
        self._users = 0
        self._linger: asyncio.Task[None] | None = None

    def base_url(self, token: str) -> str:
        return f"http://127.0.0.1:{self._port}/{token}/v1"

    async def _start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.add_routes(
            [
                web.post("/{token}/v1/chat/completions", self._route(Session.chat)),
                web.post("/{token}/v1/completions", self._route(Session.complete)),
                web.get("/{token}/v1/models", self._models),
            ]
        )
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self._port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        self._runner = runner

    async def _stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def acquire(self) -> None:
        """One more episode uses the server: start it if it is not running."""
        self._users += 1
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._runner is None:
            try:
                await self._start()
            except BaseException:
                self._users -= 1
                raise

    def release(self) -> None:
        """An episode is done with the server; the last one leaves it running `LINGER_S`."""
        self._users -= 1
        if self._users == 0 and self._linger is None:
            self._linger = asyncio.get_running_loop().create_task(self._idle())

    async def _idle(self) -> None:
        try:
            await asyncio.sleep(LINGER_S)
        finally:  # also when the loop's tasks are cancelled at its end
            if self._users == 0:
                self._linger = None
                await self._stop()

    def open(self, session: Session) -> str:
        """Serve `session` under a new token; returns the token."""
        token = secrets.token_hex(16)
        self.sessions[token] = session
        self._inflight[token] = set()
        return token

    async def close(self, token: str) -> None:
        """The episode ended: its calls in flight are cancelled, later ones get 410."""
        self.sessions.pop(token, None)
        self.ended[token] = None
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        tasks = self._inflight.pop(token, set())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _session(self, token: str) -> Session | web.Response:
        session = self.sessions.get(token)
        if session is not None:
            return session
        if token in self.ended:
            self.late_calls += 1
            log.warning("a call came after its episode ended (%d so far)", self.late_calls)
            return _error(410, "this episode has ended; its endpoint takes no more calls", "ended")
        return _error(404, "no episode is served under this path", "not_found")

    def _route(
        self, handler: Callable[[Session, JSON], Awaitable[JSON]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def route(request: web.Request) -> web.StreamResponse:
            token = request.match_info["token"]
            session = self._session(token)
            if isinstance(session, web.Response):
                return session
            try:
                body = json.loads(await request.read())
            except (ValueError, UnicodeDecodeError) as exc:
                session.record.refuse("bad json")
                return _error(400, f"the body is not JSON: {exc}", "bad_json")
            if not isinstance(body, dict):
                session.record.refuse("bad json")
                return _error(400, "the body must be a JSON object", "bad_json")
            task, inflight = asyncio.current_task(), self._inflight.get(token)
            if task is None or inflight is None:  # the episode ended while the body was read
                return _error(410, "this episode has ended", "ended")
            inflight.add(task)
            try:
                return web.json_response(await handler(session, body))
            except BadRequest as exc:
                session.record.refuse(exc.reason)
                return _error(exc.status, str(exc), exc.reason.replace(" ", "_"))
            except Exception as exc:  # a bug here fails the call, never serve
                log.exception("the endpoint failed on a call")
                session.record.refuse("endpoint error")
                return _error(500, f"{type(exc).__name__}: {exc}", "endpoint_error")
            finally:
                self._inflight.get(token, set()).discard(task)

        return route

    async def _models(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request.match_info["token"])
        if isinstance(session, web.Response):
            return session
        model = {"id": session.model, "object": "model", "created": 0, "owned_by": "dora"}
        return web.json_response({"object": "list", "data": [model]})


async def acquire() -> EndpointServer:
    """The running loop's endpoint server, started if needed; `release()` it when done."""
    loop = asyncio.get_running_loop()
    server = _SERVERS.get(loop)
    if server is None:
        server = _SERVERS[loop] = EndpointServer()
    await server.acquire()
    return server
