"""Control endpoints of an engine instance: weights, pause/resume, CPU priority, abort,
export/import.

They answer loopback callers only, unless the server has a control token, in which case every caller
must present it (`Authorization: Bearer ...`). So binding to a public address without a token leaves
control closed to the world, and binding with one opens it to whoever holds the token. Bodies are
JSON, except the two that carry raw bytes (weights, exported requests), which may be or are msgpack.
"""

from __future__ import annotations

import asyncio
import hmac
import math
from typing import TYPE_CHECKING

import msgspec
import torch
from aiohttp import web

from dora.engine import responses
from dora.engine.batcher import Batcher
from dora.engine.sequence import Sequence
from dora.engine.worker import WeightsConflict, read_safetensors
from dora.instance import api, wire
from dora.instance.interface import ExportedRequest
from dora.protocol import MSGPACK

if TYPE_CHECKING:
    from dora.engine.server import EngineServer

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class ControlRoutes:
    """The `/control/...` handlers of one EngineServer."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def routes(self) -> list[web.RouteDef]:
        return wire.control_routes(self)

    def allowed(self, request: web.Request) -> web.Response | None:
        """None where `request` may use the control routes (and the multiplexed connection);
        else the refusal."""
        if self.server.control_token:
            given = request.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {self.server.control_token}".encode()):
                return None
            return self.server.error(401, "control endpoints need a valid bearer token")
        if wire.loopback_caller(request):
            return None
        return self.server.error(403, "control endpoints answer loopback callers only")

    async def _control_body(self, request: web.Request, cls: type[api.S]) -> api.S | web.Response:
        denied = self.allowed(request)
        if denied is not None:
            return denied
        body = await self.server.read_body(
            request, self.server.max_control_bytes, timeout_s=self.server.control_body_timeout_s
        )
        if isinstance(body, web.Response):
            return body
        try:
            return wire.decode_control(body, request.content_type, cls)
        except ValueError as exc:
            return self.server.error(400, str(exc))

    async def on_load_weights(self, request: web.Request) -> web.Response:
        req = await self._control_body(request, api.LoadWeightsRequest)
        if isinstance(req, web.Response):
            return req
        try:
            tensors = _tensor_source(req)
        except ValueError as exc:
            return self.server.error(400, str(exc))
        try:
            result = await asyncio.wrap_future(
                self.server.worker.load_weights(tensors, version=req.version, mode=req.mode)
            )
        except WeightsConflict as exc:
            return self.server.error(409, f"weights not loaded: {exc}")
        except (ValueError, FileNotFoundError) as exc:
            return self.server.error(400, f"weights not loaded: {exc}")
        return web.json_response(result)

    async def on_unload_weights(self, request: web.Request) -> web.Response:
        req = await self._control_body(request, api.VersionBody)
        if isinstance(req, web.Response):
            return req
        try:
            result = await asyncio.wrap_future(self.server.worker.unload_weights(req.version))
        except KeyError as exc:
            return self.server.error(404, str(exc.args[0]))
        except ValueError as exc:
            return self.server.error(409, f"version not unloaded: {exc}")
        return web.json_response(result)

    async def on_pause(self, request: web.Request) -> web.Response:
        return await self._set_paused(request, True)

    async def on_resume(self, request: web.Request) -> web.Response:
        return await self._set_paused(request, False)

    async def _set_paused(self, request: web.Request, paused: bool) -> web.Response:
        denied = self.allowed(request)
        if denied is not None:
            return denied
        await asyncio.wrap_future(self.server.worker.set_paused(paused))
        return web.json_response({"paused": paused, "version": self.server.version})

    async def on_priority(self, request: web.Request) -> web.Response:
        req = await self._control_body(request, api.PriorityBody)
        if isinstance(req, web.Response):
            return req
        self.server.worker.set_background(req.background)
        return web.json_response({"background": req.background, "version": self.server.version})

    async def on_abort(self, request: web.Request) -> web.Response:
        req = await self._control_body(request, api.RequestIdBody)
        if isinstance(req, web.Response):
            return req
        seqs = self.server.inflight.get(req.request_id)
        if seqs is not None:
            done = await asyncio.wrap_future(
                self.server.worker.call(
                    lambda b: [
                        b.abort(s) if s.finish_reason is None else s.completion() for s in seqs
                    ]
                )
            )
        elif (recent := self.server.recent.get(req.request_id)) is not None:
            done = recent
        else:
            return self.server.error(404, f"unknown request_id {req.request_id!r}")
        completions = [wire.completion_dict(c) for c in done]
        return wire.answer(
            {"request_id": req.request_id, "completions": completions},
            request,
            version=self.server.version,
        )

    async def on_export(self, request: web.Request) -> web.Response:
        req = await self._control_body(request, api.RequestIdBody)
        if isinstance(req, web.Response):
            return req
        seqs = self.server.inflight.get(req.request_id)
        if seqs is None:
            return self.server.error(404, f"request_id {req.request_id!r} is not in flight")
        if len(seqs) != 1:
            return self.server.error(400, "only requests with n = 1 can be exported")
        seq = seqs[0]

        def detach(b: Batcher) -> ExportedRequest | None:
            if seq.finish_reason is not None:
                return None
            version = b.version_of(seq)
            kv = b.detach(seq)
            return _exported(seq, version, kv)

        exported = await asyncio.wrap_future(self.server.worker.call(detach))
        if exported is None:
            return self.server.error(409, f"request {req.request_id!r} already finished")
        return web.Response(body=msgspec.msgpack.encode(exported), content_type=MSGPACK)

    async def on_import(self, request: web.Request) -> web.Response:
        req = await self._control_body(request, ExportedRequest)
        if isinstance(req, web.Response):
            return req
        batcher = self.server.worker.batcher
        try:
            api.check_imported(req, batcher.vocab_size, batcher.max_model_len)
        except ValueError as exc:
            return self.server.error(400, f"cannot import this request: {exc}")
        held = self.server.worker.batcher.held_versions()
        if req.version not in held:
            return self.server.error(
                409, f"request holds version {req.version}, engine holds {held}"
            )
        if req.request_id in self.server.inflight:
            return self.server.error(400, f"request_id {req.request_id!r} is already in flight")
        seq = Sequence(
            id=req.request_id,
            prompt_ids=list(req.prompt_ids),
            params=req.params,
            key=req.key,
            version=req.version,
            token_ids=list(req.token_ids),
            logprobs=list(req.logprobs),
            versions=list(req.versions),
        )
        if req.kv:
            problem = self.server.worker.batcher.kv_layout_problem(
                req.kv_shape, req.kv_dtype, len(req.prompt_ids) + len(req.token_ids) - 1
            )
            if problem:
                return self.server.error(400, f"cannot import this KV cache: {problem}")
            kv = torch.frombuffer(bytearray(req.kv), dtype=torch.uint8).view(_DTYPES[req.kv_dtype])
            seq.kv_import = kv.reshape(req.kv_shape)
        elif req.token_ids:
            return self.server.error(400, "a request with sampled tokens needs its KV cache")
        watch = self.server.watch(seq)
        self.server.inflight[req.request_id] = [seq]
        self.server.worker.call(lambda b: b.add(seq))
        await self.server.wait(req.request_id, [watch])
        if seq.error:
            return self.server.error(seq.error_status, seq.error)
        out = wire.completion_dict(seq.completion())
        return wire.answer(out, request, version=out["version"])


def _exported(seq: Sequence, version: int, kv: torch.Tensor | None) -> ExportedRequest:
    raw, dtype, shape = b"", "", []
    if kv is not None:
        raw = kv.contiguous().view(torch.uint8).numpy().tobytes()
        dtype, shape = str(kv.dtype).removeprefix("torch."), list(kv.shape)
    return ExportedRequest(
        request_id=seq.id,
        version=version,
        prompt_ids=seq.prompt_ids,
        token_ids=list(seq.token_ids),
        logprobs=list(seq.logprobs),
        versions=list(seq.versions),
        params=seq.params,
        key=seq.key,
        kv=raw,
        kv_dtype=dtype,
        kv_shape=shape,
    )


def _tensor_source(req: api.LoadWeightsRequest) -> responses.TensorSource:
    if req.path:
        path = req.path
        return lambda: read_safetensors(path)
    if not (len(req.names) == len(req.dtypes) == len(req.shapes) == len(req.data)) or not req.names:
        raise ValueError(
            "give either path or names, dtypes, shapes and data of equal, non-zero length"
        )
    dtypes = [d.removeprefix("torch.") for d in req.dtypes]  # "torch.float32" works too
    unknown = sorted({d for d in dtypes if d not in _DTYPES})
    if unknown:
        raise ValueError(f"unsupported dtypes {unknown}; use one of {sorted(_DTYPES)}")

    for name, dtype, shape, data in zip(req.names, dtypes, req.shapes, req.data, strict=True):
        if any(d < 0 for d in shape):
            raise ValueError(f"{name}: shape {shape} has a negative dimension")
        size = math.prod(shape) * _DTYPES[dtype].itemsize
        if size != len(data):
            raise ValueError(
                f"{name}: {len(data)} bytes of data, but a {dtype} tensor of shape {shape} "
                f"holds {size}"
            )

    def build() -> dict[str, torch.Tensor]:
        return {
            name: torch.frombuffer(bytearray(data), dtype=_DTYPES[dtype]).reshape(shape)
            for name, dtype, shape, data in zip(
                req.names, dtypes, req.shapes, req.data, strict=True
            )
        }

    return build
