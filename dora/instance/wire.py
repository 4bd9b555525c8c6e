"""What the engine's HTTP API looks like apart from the model: the control route table, who may
call it, how its bodies decode, the error body, and a completion as JSON.

Torch-free, so that another backend speaking the same API (the emulated instance,
dora/emulated/server.py) answers exactly as the engine does: `EngineClient` then cannot tell them
apart. The engine's control routes (control.py) and the emulated server both build their control
table with `control_routes`, decode with `decode_control` and describe errors with `error_body`;
both remember their latest finished requests in `RecentCompletions`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
from aiohttp import web

from dora.instance import api
from dora.instance.session import UNKNOWN_SESSION
from dora.net import is_loopback
from dora.protocol import (
    MSGPACK,
    Completion,
    PackedCompletion,
    as_array,
    encode_arrays,
    encode_json,
)

__all__ = [
    "UNKNOWN_SESSION",
    "ControlHandlers",
    "RecentCompletions",
    "answer",
    "completion_dict",
    "control_routes",
    "decode_control",
    "encode_answer",
    "error_body",
    "loopback_caller",
]

Json = dict[str, object]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_KINDS = {400: "invalid_request_error", 404: "not_found", 409: "version_mismatch"}


class ControlHandlers(Protocol):
    """The handlers of the `/control/...` routes (docs/engine.md, "Control")."""

    async def on_load_weights(self, request: web.Request) -> web.StreamResponse: ...
    async def on_unload_weights(self, request: web.Request) -> web.StreamResponse: ...
    async def on_pause(self, request: web.Request) -> web.StreamResponse: ...
    async def on_resume(self, request: web.Request) -> web.StreamResponse: ...
    async def on_priority(self, request: web.Request) -> web.StreamResponse: ...
    async def on_abort(self, request: web.Request) -> web.StreamResponse: ...
    async def on_export(self, request: web.Request) -> web.StreamResponse: ...
    async def on_import(self, request: web.Request) -> web.StreamResponse: ...


def control_routes(handlers: ControlHandlers) -> list[web.RouteDef]:
    """The control route table, every route a POST."""
    table: list[tuple[str, Handler]] = [
        ("load_weights", handlers.on_load_weights),
        ("unload_weights", handlers.on_unload_weights),
        ("pause", handlers.on_pause),
        ("resume", handlers.on_resume),
        ("priority", handlers.on_priority),
        ("abort", handlers.on_abort),
        ("export", handlers.on_export),
        ("import", handlers.on_import),
    ]
    return [web.post(f"/control/{name}", handler) for name, handler in table]


def loopback_caller(request: web.Request) -> bool:
    """Whether the caller is on this host (control answers only such callers without a token)."""
    return is_loopback(request.remote or "")


def decode_control(body: bytes, content_type: str, cls: type[api.S]) -> api.S:
    """A control body: msgpack when sent as `application/msgpack`, strict JSON otherwise (an
    empty body is `{}`). Raises ValueError with a message for the caller."""
    try:
        if content_type == MSGPACK:
            return msgspec.msgpack.decode(body, type=cls)
        return api.decode_strict(body or b"{}", cls)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from exc
    except RecursionError:
        raise ValueError("body is nested too deeply to decode") from None


def error_body(status: int, message: str, version: int, *, kind: str | None = None) -> Json:
    """The JSON of an error answer: OpenAI's `error` object (its `type` is `kind`, by default
    named for the status) and the version the instance holds."""
    kind = kind or _KINDS.get(status, "error")
    return {"error": {"message": message, "type": kind, "code": status}, "version": version}


_msgpack_encode = msgspec.msgpack.Encoder(enc_hook=encode_arrays).encode
_json_encode = encode_json


def encode_answer(body: object) -> bytes:
    """A successful answer in msgpack, its typed arrays as raw bytes (as `answer` sends it)."""
    return _msgpack_encode(body)


def answer(body: object, request: web.Request, *, version: object) -> web.Response:
    """A successful answer to `request`: msgpack when its `Accept` names `application/msgpack`
    (dora's client asks so for completions), JSON otherwise. `X-Dora-Version` carries `version`.

    A typed array in `body` (a completion's tokens, log-probs and versions) is raw little-endian
    bytes in msgpack, which the client turns back into an array with one copy (a 3,000-token
    completion: about 7 us instead of 1 ms through lists), and a list of numbers in JSON."""
    if MSGPACK in request.headers.get("Accept", ""):
        data, kind = _msgpack_encode(body), MSGPACK
    else:
        data, kind = _json_encode(body), "application/json"
    return web.Response(body=data, content_type=kind, headers={"X-Dora-Version": str(version)})


def completion_dict(c: Completion) -> Json:
    """A completion as the abort and import routes answer it (what `EngineClient` decodes), its
    sequences as typed arrays (`answer` sends them as bytes in msgpack, as lists in JSON)."""
    return {
        "request_id": c.request_id,
        "token_ids": as_array("i", c.token_ids),
        "logprobs": as_array("f", c.logprobs),
        "versions": as_array("i", c.versions),
        "finish_reason": c.finish_reason,
        "prompt_tokens": c.prompt_tokens,
        "version": c.version,
    }


class RecentCompletions:
    """The completions of the last `size` finished requests, for an abort that races the end.

    Kept msgpack-encoded: as Python objects, thousands of finished token lists would sit in the
    garbage collector's heap and every collection would walk each of their elements (at 128
    emulated instances, that was most of a collection's pause). They come back with typed arrays."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(list[PackedCompletion]).decode

    def add(self, request_id: str, completions: list[Completion]) -> None:
        self._items[request_id] = self._encode([PackedCompletion.of(c) for c in completions])
        self._items.move_to_end(request_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def get(self, request_id: str) -> list[Completion] | None:
        raw = self._items.get(request_id)
        return None if raw is None else [c.unpack() for c in self._decode(raw)]
