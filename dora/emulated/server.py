"""The HTTP face of an emulated instance: the embedded engine's API and control routes.

`dora serve` talks to an emulated instance with its ordinary `EngineClient`, over HTTP, exactly as
to an embedded engine: `POST /v1/completions` (token ids in; token ids, behaviour logprobs and
per-token versions out; `version` pins the request, another version answers 409), `GET /health`,
`GET /metrics`, `GET /v1/models`, and `/control/load_weights`, `pause`, `resume`, `abort`, `export`,
`import`; completions also over one multiplexed connection (`GET /v1/mux`,
`dora.instance.mux_server`), with the engine's sessions (`dora.instance.session_store`). Request
bodies are decoded by the engine's own strict schemas (`dora.instance.api`, the HTTP contract both
serve), so a field the engine would refuse is refused here too. What differs: the prompt must be
token ids (there is no tokenizer), `n` must be 1 (dora's router sends one sample per call), a weight
load accepts the tensors or the path and ignores their values (there is no model; the load takes the
modelled time), and an exported request carries no KV bytes: its `kv_shape` is `[context tokens]`
and the importer spends the modelled transfer time.

Responses are encoded with msgspec in the engine's shapes; completions (generate and import) in
msgpack when the caller asks for it (`Accept`), as the engine does (`wire.answer`).
"""

from __future__ import annotations

import asyncio
from typing import cast

import msgspec
from aiohttp import web

from dora.emulated.instance import EmulatedInstance, Sequence
from dora.instance import api, wire
from dora.instance import mux_server as mux
from dora.instance.session_store import SessionStore, UnknownSession
from dora.protocol import MSGPACK, Completion, SamplingParams

__all__ = ["EmulatedServer"]

_MAX_BODY = 4 << 30
_KV_DTYPE = "emulated"


class EmulatedServer:
    """The aiohttp app of one `EmulatedInstance`."""

    def __init__(self, instance: EmulatedInstance, *, model_name: str = "emulated") -> None:
        self.instance = instance
        self.model_name = model_name
        self.recent = wire.RecentCompletions(256)  # an abort racing the end needs only the latest
        self.sessions = SessionStore()
        self.app = web.Application(client_max_size=_MAX_BODY)
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/v1/mux", self._mux),
                *wire.control_routes(self),
            ]
        )

    # --- plumbing ----------------------------------------------------------------------------

    def _json(self, body: object, status: int = 200) -> web.Response:
        return web.Response(
            body=msgspec.json.encode(body),
            status=status,
            content_type="application/json",
            headers={"X-Dora-Version": str(self.instance.version)},
        )

    def _error(self, status: int, message: str, *, kind: str | None = None) -> web.Response:
        body = wire.error_body(status, message, self.instance.version, kind=kind)
        return self._json(body, status)

    async def _control(self, request: web.Request, cls: type[api.S]) -> api.S | web.Response:
        if not wire.loopback_caller(request):
            return self._error(403, "control endpoints answer loopback callers only")
        try:
            return wire.decode_control(await request.read(), request.content_type, cls)
        except ValueError as exc:
            return self._error(400, str(exc))

    async def _wait(self, seq: Sequence) -> Completion:
        assert seq.future is not None
        try:
            out = await asyncio.shield(seq.future)
        except asyncio.CancelledError:  # the caller went away: the request stops, as in vLLM
            if not seq.future.done():
                self.instance.take(seq)
            raise
        self.recent.add(out.request_id, [out])
        return out

    # --- the OpenAI route --------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.Response:
        out = await self._complete(await request.read())
        if isinstance(out, web.Response):
            return out
        return wire.answer(out, request, version=self.instance.version)

    async def _mux(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/mux`: completions over one multiplexed connection
        (`dora.instance.mux_server`)."""
        denied = None
        if not wire.loopback_caller(request):
            denied = self._error(403, "the multiplexed connection answers loopback callers only")
        return await mux.serve_mux(request, self._complete_frame, denied)

    async def _complete_frame(self, body: bytes) -> tuple[int, bytes]:
        out = await self._complete(body)
        if isinstance(out, web.Response):
            return out.status, bytes(cast(bytes, out.body))
        return 200, wire.encode_answer(out)

    async def _complete(self, body: bytes) -> dict[str, object] | web.Response:
        """One completion: its answer, or the error response."""
        inst = self.instance
        try:
            req = api.decode_strict(body, api.CompletionRequest)
            if isinstance(req.prompt, str):
                raise ValueError("an emulated instance has no tokenizer: send the prompt as ids")
            if req.n != 1:
                raise ValueError(f"an emulated instance samples n = 1 per request, not {req.n}")
            self.sessions.release(req.release_sessions or ())
            req.check_session()
            prompt = (
                self.sessions.prompt(req.session_id, req.session_extends, req.prompt)
                if req.session_id is not None
                else req.prompt
            )
            if not prompt:
                raise ValueError("prompt is empty: give at least one token")
        except UnknownSession as exc:
            return self._error(404, str(exc), kind=wire.UNKNOWN_SESSION)
        except ValueError as exc:
            return self._error(400, str(exc))
        if req.version is not None and req.version != inst.version:
            return self._error(
                409, f"request pinned to version {req.version}, holds {inst.version}"
            )
        request_id = req.request_id or f"cmpl-{id(req):x}"
        if inst.find(request_id) is not None:
            return self._error(400, f"request_id {request_id!r} is already in flight")
        plan = inst.model.plan(request_id, prompt)
        left = plan.length - plan.offset
        max_tokens = req.max_tokens or 16
        seq = Sequence(
            id=request_id,
            prompt_ids=list(prompt),
            plan=plan,
            target=min(left, max_tokens),
            finish="stop" if left <= max_tokens else "length",
            version=inst.version,
            prefill_from=plan.prefix if plan.prefix else -1,
        )
        inst.submit(seq)
        out = await self._wait(seq)
        if req.session_id is not None:
            self.sessions.keep(req.session_id, prompt, out.token_ids)
        choice = {
            "index": 0,
            "text": "",
            "finish_reason": out.finish_reason,
            "logprobs": {"token_logprobs": out.logprobs},
            "token_ids": out.token_ids,
            "versions": out.versions,
        }
        return {
            "id": request_id,
            "object": "text_completion",
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(seq.prompt_ids),
                "completion_tokens": len(out.token_ids),
            },
            "version": out.version,
        }

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "owned_by": "dora-emulated"}
        return self._json({"object": "list", "data": [card], "version": self.instance.version})

    async def _health(self, request: web.Request) -> web.Response:
        inst = self.instance
        return self._json({"status": "ok", "version": inst.version, "paused": inst.paused})

    async def _metrics(self, request: web.Request) -> web.Response:
        inst = self.instance
        return self._json({"version": inst.version, "paused": inst.paused, **inst.stats()})

    # --- control -----------------------------------------------------------------------------

    async def on_load_weights(self, request: web.Request) -> web.Response:
        req = await self._control(request, api.LoadWeightsRequest)
        if isinstance(req, web.Response):
            return req
        if not req.path and not req.names:
            return self._error(400, "give either path or names, dtypes, shapes and data")
        inst = self.instance
        previous = inst.version
        aborted: list[str] = []
        if req.mode == "abort":
            aborted = [c.request_id for c in inst.abort_all()]
        elif req.mode == "drain":
            await inst.idle.wait()
        load_s = await inst.load(req.version, keep=req.mode == "keep")
        return self._json(
            {
                "version": req.version,
                "previous_version": previous,
                "aborted": aborted,
                "load_s": load_s,
            }
        )

    async def on_unload_weights(self, request: web.Request) -> web.Response:
        """An emulated instance holds one full-weight version and no adapters: it answers as an
        engine without adapters does."""
        req = await self._control(request, api.VersionBody)
        if isinstance(req, web.Response):
            return req
        if req.version == self.instance.version:
            return self._error(409, f"version not unloaded: version {req.version} is the newest")
        return self._error(404, f"version {req.version} is not an adapter held here")

    async def on_pause(self, request: web.Request) -> web.Response:
        return await self._set_paused(request, True)

    async def on_resume(self, request: web.Request) -> web.Response:
        return await self._set_paused(request, False)

    async def _set_paused(self, request: web.Request, paused: bool) -> web.Response:
        if not wire.loopback_caller(request):
            return self._error(403, "control endpoints answer loopback callers only")
        self.instance.set_paused(paused)
        return self._json({"paused": paused, "version": self.instance.version})

    async def on_priority(self, request: web.Request) -> web.Response:
        """The modelled compute takes no CPU to give way with: the emulated instance accepts the
        call as an engine does and steps as before."""
        req = await self._control(request, api.PriorityBody)
        if isinstance(req, web.Response):
            return req
        return self._json({"background": req.background, "version": self.instance.version})

    async def on_abort(self, request: web.Request) -> web.Response:
        req = await self._control(request, api.RequestIdBody)
        if isinstance(req, web.Response):
            return req
        seq = self.instance.find(req.request_id)
        if seq is not None:
            out = self.instance.take(seq)
        elif (recent := self.recent.get(req.request_id)) is not None:
            out = recent[0]
        else:
            return self._error(404, f"unknown request_id {req.request_id!r}")
        completions = [wire.completion_dict(out)]
        return wire.answer(
            {"request_id": req.request_id, "completions": completions},
            request,
            version=self.instance.version,
        )

    async def on_export(self, request: web.Request) -> web.Response:
        req = await self._control(request, api.RequestIdBody)
        if isinstance(req, web.Response):
            return req
        seq = self.instance.find(req.request_id)
        if seq is None:
            if req.request_id in self.recent:
                return self._error(409, f"request {req.request_id!r} already finished")
            return self._error(404, f"request_id {req.request_id!r} is not in flight")
        out = self.instance.take(seq)
        exported = api.ExportedRequest(
            request_id=seq.id,
            version=self.instance.version,
            prompt_ids=seq.prompt_ids,
            token_ids=list(out.token_ids),
            logprobs=list(out.logprobs),
            versions=list(out.versions),
            params=_params(seq),
            key=0,
            kv=_KV_DTYPE.encode(),
            kv_dtype=_KV_DTYPE,
            kv_shape=[len(seq.prompt_ids) + len(out.token_ids)],
        )
        return web.Response(body=msgspec.msgpack.encode(exported), content_type=MSGPACK)

    async def on_import(self, request: web.Request) -> web.Response:
        req = await self._control(request, api.ExportedRequest)
        if isinstance(req, web.Response):
            return req
        inst = self.instance
        if req.version != inst.version:
            return self._error(409, f"request holds version {req.version}, instance {inst.version}")
        if inst.find(req.request_id) is not None:
            return self._error(400, f"request_id {req.request_id!r} is already in flight")
        if req.token_ids and req.kv_dtype != _KV_DTYPE:
            return self._error(400, f"cannot import a KV cache of dtype {req.kv_dtype!r}")
        plan = inst.model.plan(req.request_id, req.prompt_ids)
        left = plan.length - plan.offset
        max_tokens = req.params.max_tokens
        seq = Sequence(
            id=req.request_id,
            prompt_ids=list(req.prompt_ids),
            plan=plan,
            target=min(left, max_tokens),
            finish="stop" if left <= max_tokens else "length",
            version=inst.version,
            done=float(len(req.token_ids)),
            token_ids=list(req.token_ids),
            logprobs=list(req.logprobs),
            versions=list(req.versions),
            prefill_from=len(req.prompt_ids) + len(req.token_ids) if req.token_ids else -1,
        )
        stall = 0.0
        if req.token_ids:  # the KV cache crosses the network
            moved = len(seq.prompt_ids) + len(req.token_ids)
            stall = moved * inst.s.kv_bytes_per_token / (inst.s.kv_transfer_gbps * 1e9)
        inst.submit(seq, stall_s=stall)
        out = await self._wait(seq)
        return wire.answer(wire.completion_dict(out), request, version=self.instance.version)


def _params(seq: Sequence) -> SamplingParams:
    # the call's whole budget: what it sampled so far plus what it may still sample
    return SamplingParams(max_tokens=max(1, seq.target))
