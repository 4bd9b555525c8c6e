"""The OpenEnv server an `OpenEnvEnv` talks to: one at a URL, or an app started here, checked once.

OpenEnv (`openenv-core`) serves an environment as a FastAPI app (`create_app` /
`create_fastapi_app` in `openenv.core.env_server`): `GET /health`, `GET /schema` (the JSON schemas
of its Action, Observation and State) and `/ws`, a WebSocket on which each connection is one
session with its own `Environment` object, driven by `reset`, `step`, `state` and `close`
messages. Its HTTP `POST /reset` and `POST /step` build a fresh `Environment` for every request, so
an episode of several steps must use the WebSocket, which OpenEnv's own `GenericEnvClient` does.

`OpenEnvServer.resolve` runs once per process (from `OpenEnvEnv.setup`, off serve's event loop):

- `url`: a server that runs already (`uvicorn my_env.server.app:app --port 8000`, a Hugging Face
  Space, a container someone else started); `app`: the `module:attribute` of such an app, which is
  served here by uvicorn on 127.0.0.1, on a port the system picks, in a thread of this process
  (no container, no subprocess; it shares the process, and its GIL, with serve);
- both are probed (`/health`, then `/schema`) with a deadline, so an unreachable server or one that
  is not OpenEnv's stops the run at start with an error naming the key, not in the middle of a run;
- `openenv` itself is imported here: importing it takes seconds (it pulls in gradio and fastmcp),
  which must not happen on serve's event loop.

`SessionLimit` bounds the sessions this process holds at once: an OpenEnv server refuses a session
past its `max_concurrent_envs` (`CAPACITY_REACHED`), so episodes past the limit wait for a session
instead of failing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from typing import Any

from dora import ConfigError, load_object

JSON = dict[str, Any]


class LocalApp:
    """An OpenEnv (ASGI) app served by uvicorn on 127.0.0.1 in a daemon thread of this process.

    The socket is bound and listening before the thread starts, so the URL is usable at once:
    connections wait in the backlog until uvicorn accepts them. `close()` stops the server.
    """

    def __init__(self, app: object, *, name: str) -> None:
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(128)
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        # log_config=None: the server's records go through this process's logging (dora's), not
        # through handlers of uvicorn's own.
        config = uvicorn.Config(app, log_config=None, log_level="warning")  # type: ignore[arg-type]
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name=name, daemon=True
        )
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving and wait (at most `timeout_s`) for the thread to end."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()


class SessionLimit:
    """At most `limit` sessions held at once by this process (0: no limit).

    One semaphore per event loop: the warm-up runs episodes' hooks under `asyncio.run`, serve on its
    own loop, and an asyncio semaphore belongs to the loop that first waits on it.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def acquire(self) -> asyncio.Semaphore | None:
        """Wait for a session; returns what `release` takes back (None when unlimited)."""
        if not self.limit:
            return None
        loop = asyncio.get_running_loop()
        semaphore = self._by_loop.setdefault(loop, asyncio.Semaphore(self.limit))
        await semaphore.acquire()
        return semaphore

    @staticmethod
    def release(held: asyncio.Semaphore | None) -> None:
        if held is not None:
            held.release()


@dataclass
class OpenEnvServer:
    """A checked OpenEnv server: its URL, its action schema, the client class, the session limit,
    and the local app when this process serves it (stopped by `close`)."""

    url: str
    action_schema: JSON
    client_cls: type
    sessions: SessionLimit
    local: LocalApp | None = field(default=None, repr=False)

    @classmethod
    def resolve(
        cls, *, url: str = "", app: str = "", max_sessions: int = 0, timeout_s: float = 60.0
    ) -> OpenEnvServer:
        """Find (`url`) or start (`app`) the server and probe it; a ConfigError names the key."""
        check_one_source(url=url, app=app)
        from openenv.core.generic_client import GenericEnvClient  # slow: off the loop, once

        local = None
        key = f"env.kwargs.url={url!r}"
        if app:
            key = f"env.kwargs.app={app!r}"
            local = LocalApp(_load_app(app), name=f"openenv-{app}")
            url = local.url
        elif not url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ConfigError(f"{key}: use an http://, https://, ws:// or wss:// URL")
        try:
            _get(url, "/health", key=key, timeout_s=timeout_s)
            schema = _get(url, "/schema", key=key, timeout_s=timeout_s)
        except ConfigError:
            if local is not None:
                local.close()
            raise
        action = schema.get("action")
        if not isinstance(action, dict):
            if local is not None:
                local.close()
            raise ConfigError(f"{key}: {url}/schema has no action schema; is it an OpenEnv server?")
        return cls(
            url=url,
            action_schema=action,
            client_cls=GenericEnvClient,
            sessions=SessionLimit(max_sessions),
            local=local,
        )

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
            self.local = None


def check_one_source(*, url: str, app: str) -> None:
    """Exactly one of `url` and `app`, or a ConfigError that explains both."""
    if bool(url) == bool(app):
        raise ConfigError(
            "env.kwargs: set exactly one of url (a running OpenEnv server, e.g. "
            "'http://127.0.0.1:8000') and app (the 'module:attribute' of an OpenEnv app to "
            f"serve here, e.g. 'my_env.server.app:app'); got url={url!r}, app={app!r}"
        )


def http_url(url: str) -> str:
    """The HTTP form of a server URL (OpenEnv's clients accept ws:// too)."""
    for ws, http in (("ws://", "http://"), ("wss://", "https://")):
        if url.startswith(ws):
            return http + url.removeprefix(ws)
    return url.rstrip("/")


def _load_app(spec: str) -> object:
    try:
        app = load_object(spec)
    except ConfigError as exc:
        raise ConfigError(f"env.kwargs.app={spec!r}: {exc}") from exc
    if isinstance(app, type) or not callable(app):
        raise ConfigError(
            f"env.kwargs.app={spec!r} is {app!r}, not an ASGI app: name the app that "
            "openenv.core.env_server.create_app made (an OpenEnv environment's server/app.py "
            "exports it as `app`)"
        )
    return app


def _get(url: str, path: str, *, key: str, timeout_s: float) -> JSON:
    """GET a JSON object from the server; every failure is a ConfigError naming `key`."""
    where = f"{http_url(url)}{path}"
    try:
        with urllib.request.urlopen(where, timeout=timeout_s) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ConfigError(
            f"{key}: {where} answered HTTP {exc.code}; is it an OpenEnv server?"
        ) from exc
    except (OSError, ValueError) as exc:  # refused, unreachable, timed out, not JSON
        raise ConfigError(
            f"{key}: no OpenEnv server answers at {where} ({exc}); start the environment's "
            "server (e.g. `uvicorn my_env.server.app:app --host 127.0.0.1 --port 8000`) or set "
            "env.kwargs.app to serve its app in this process"
        ) from exc
    if not isinstance(body, dict):
        raise ConfigError(f"{key}: {where} answered {body!r}, not a JSON object")
    return body


def text_field(schema: JSON, *, key: str) -> str:
    """The action field the model's reply fills: the schema's only required string field, else its
    only string field; several or none is a ConfigError naming `key`."""
    properties = schema.get("properties") or {}
    strings = [name for name, prop in properties.items() if _is_string(prop)]
    required = [name for name in strings if name in (schema.get("required") or [])]
    for candidates in (required, strings):
        if len(candidates) == 1:
            return candidates[0]
    if len(required) > 1 or len(strings) > 1:
        raise ConfigError(
            f"{key}: the action {schema.get('title', '')!r} has several text fields "
            f"({', '.join(required or strings)}); set env.kwargs.action_field to the one the "
            "model's reply goes into, or env.kwargs.action to a function that builds the action"
        )
    raise ConfigError(
        f"{key}: the action {schema.get('title', '')!r} has no text field (its fields: "
        f"{', '.join(properties) or 'none'}); set env.kwargs.action to a 'module:function' that "
        "builds the action from the model's reply"
    )


def _is_string(prop: object) -> bool:
    if not isinstance(prop, dict):
        return False
    if prop.get("type") == "string":
        return True
    return any(_is_string(p) for p in prop.get("anyOf", []))
