"""The engine's aiohttp app: OpenAI-compatible endpoints plus dora's control endpoints.

The event loop only parses, validates and formats; the model runs on the engine thread (worker.py).
A sequence's progress reaches the loop through `loop.call_soon_threadsafe`, so nothing here blocks
on torch. Every response carries the weight version that produced it: a `"version"` body field and
an `X-Dora-Version` header (the version of the first sampled token for completions; the current one
for everything else).

The control endpoints (`/control/...`, control.py) share this app and its plumbing, and so does
`GET /v1/mux`: completions as frames over one long-lived connection per client (mux.py),
authenticated as control is. Completions may continue a session (sessions.py).

Bad input is a 4xx with a message that names the problem, never a crash: a body over the route's
limit (`max_request_bytes` for the OpenAI routes, `max_control_bytes` for control, which carries
weights) is refused as it streams in, with 413; a body that is not UTF-8 JSON, a field that is
unknown or of the wrong type (api.py), and a prompt that does not fit the context are 400s.
The server binds 127.0.0.1 by default; it refuses to bind any other address without a control
token (docs/reliability.md, "Security").

A request whose HTTP caller goes away is aborted; finished results are remembered for a while, so an
abort that races with the end of a request still returns the whole completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import torch
from aiohttp import web

from dora.engine import responses
from dora.engine.batcher import Batcher, BatcherConfig
from dora.engine.control import ControlRoutes
from dora.engine.sequence import Sequence
from dora.engine.worker import EngineWorker
from dora.errors import ConfigError
from dora.instance import api, wire
from dora.instance import mux_server as mux
from dora.instance.session_store import SessionStore, UnknownSession
from dora.instance.transport import SERVER_KEEPALIVE_S
from dora.net import is_loopback
from dora.protocol import SamplingParams

REQUEST_LOG_ENV = "DORA_ENGINE_REQUEST_LOG"
"""Names a file each engine appends its finished requests to (request id, prompt ids, sampled
ids, versions): an audit of what it was prompted with and sampled, for checks of token-exactness."""

MAX_REQUEST_BYTES = 16 << 20
MAX_CONTROL_BYTES = 4 << 30  # weights travel through /control/load_weights
BODY_TIMEOUT_S = 30.0
"""Deadline for reading one request body on the OpenAI routes (a client that trickles its body
would hold a connection forever); control bodies, which carry weights, get the longer
`CONTROL_BODY_TIMEOUT_S`."""
CONTROL_BODY_TIMEOUT_S = 600.0
STALL_S = 10.0
"""How long the engine thread may spend in one step or command before `/health` calls it stalled
(serve's default `serve.health_timeout_s`)."""


class Watch:
    """The loop's view of one sequence: how many tokens are out, and whether it is finished."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, seq: Sequence, changed: asyncio.Event
    ) -> None:
        self.seq = seq
        self.count = 0
        self.done = False
        self._loop = loop
        self._changed = changed
        self.finished = asyncio.Event()
        seq.listener = self._on_engine_thread

    def _on_engine_thread(self, seq: Sequence) -> None:
        count, done = len(seq.token_ids), seq.finish_reason is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._update, count, done)

    def _update(self, count: int, done: bool) -> None:
        self.count = max(self.count, count)
        if done and not self.done:
            self.done = True
            self.finished.set()
        self._changed.set()


@dataclass(frozen=True)
class _Started:
    """A generate request whose sequences the engine thread has: what answering it needs."""

    req: api.CompletionRequest | api.ChatRequest
    meta: responses.Meta
    watches: list[Watch]
    prompt_ids: list[int]


class EngineServer:
    """One engine instance: model, engine thread and HTTP app. Use `EngineServer.start(...)`."""

    def __init__(
        self,
        worker: EngineWorker,
        tokenizer: object,
        *,
        model_name: str,
        control_token: str | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_control_bytes: int = MAX_CONTROL_BYTES,
        body_timeout_s: float = BODY_TIMEOUT_S,
        stall_s: float = STALL_S,
    ) -> None:
        self.worker = worker
        self.stall_s = stall_s
        self.body_timeout_s = body_timeout_s
        self.control_body_timeout_s = CONTROL_BODY_TIMEOUT_S
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.control_token = control_token
        self.max_request_bytes = max_request_bytes
        self.max_control_bytes = max_control_bytes
        self.url = ""
        self._renderer = responses.Renderer(tokenizer, worker.batcher.eos_token_ids)
        self.inflight: dict[str, list[Sequence]] = {}
        self.recent = wire.RecentCompletions(4096)
        self.sessions = SessionStore()
        self.request_log = os.environ.get(REQUEST_LOG_ENV) or None
        """A file that every finished request is appended to, as a JSON line (an audit of what
        the engine was prompted with and sampled; off unless the variable is set)."""
        self.controls = ControlRoutes(self)
        # read_body enforces each route's limit while the body streams in; this is the backstop
        self.app = web.Application(
            client_max_size=max(max_request_bytes, max_control_bytes),
            middlewares=[self._version_header],
        )
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/v1/mux", self._mux),
                *self.controls.routes(),
            ]
        )

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls,
        model_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        version: int = 0,
        threads: int | None = None,
        config: BatcherConfig | None = None,
        control_token: str | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_control_bytes: int = MAX_CONTROL_BYTES,
        body_timeout_s: float = BODY_TIMEOUT_S,
        stall_s: float = STALL_S,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> AsyncIterator[EngineServer]:
        """Load the model in `dtype` on `device`, start the engine thread and serve; stop all
        of it on exit."""
        if not is_loopback(host) and not control_token:
            raise ConfigError(
                f"the engine would bind {host!r}, off loopback, with no control token: set "
                "serve.token (python -m dora.engine reads it from $DORA_ENGINE_TOKEN)"
            )
        if threads is not None:
            torch.set_num_threads(threads)
        model, loaded = await asyncio.to_thread(load_model, model_dir, dtype, device)
        tok: Any = loaded
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        batcher = Batcher(
            model, eos_token_ids=eos, decode=tok.decode, version=version, config=config
        )
        worker = EngineWorker(batcher, threads=threads)
        server = cls(
            worker,
            tok,
            model_name=Path(model_dir).name,
            control_token=control_token,
            max_request_bytes=max_request_bytes,
            max_control_bytes=max_control_bytes,
            body_timeout_s=body_timeout_s,
            stall_s=stall_s,
        )
        runner = web.AppRunner(
            server.app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=SERVER_KEEPALIVE_S,  # aiohttp's 75 s is shorter than the client's
        )
        worker.start()
        try:
            await runner.setup()
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound = runner.addresses[0]
            shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
            server.url = f"http://{shown}:{bound[1]}"
            yield server
        finally:
            await runner.cleanup()
            await asyncio.to_thread(worker.stop)

    @property
    def version(self) -> int:
        return self.worker.batcher.version

    def watch(self, seq: Sequence) -> Watch:
        """Follow `seq` from the event loop (call on the loop, before the engine sees `seq`)."""
        return Watch(asyncio.get_running_loop(), seq, asyncio.Event())

    # -- plumbing ----------------------------------------------------------------------------------

    @web.middleware
    async def _version_header(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        response = await handler(request)
        if not response.prepared:
            response.headers.setdefault("X-Dora-Version", str(self.version))
        return response

    def error(self, status: int, message: str, *, kind: str | None = None) -> web.Response:
        return web.json_response(
            wire.error_body(status, message, self.version, kind=kind), status=status
        )

    async def read_body(
        self, request: web.Request, limit: int, *, timeout_s: float | None = None
    ) -> bytes | web.Response:
        """The whole body, or a 413 as soon as it exceeds `limit` (chunked bodies included: it
        is never buffered past the limit), or a 408 if it has not all arrived within `timeout_s`
        (default `body_timeout_s`)."""
        if request.content_length is not None and request.content_length > limit:
            return self.error(
                413, f"request body of {request.content_length} bytes exceeds the limit of {limit}"
            )
        deadline = self.body_timeout_s if timeout_s is None else timeout_s
        body = bytearray()
        try:
            async with asyncio.timeout(deadline):
                async for chunk in request.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > limit:
                        return self.error(413, f"request body exceeds the limit of {limit} bytes")
        except TimeoutError:
            response = self.error(
                408, f"request body not received within {deadline:g} s ({len(body)} bytes came)"
            )
            response.force_close()  # the rest of a trickled body must not be read as a request
            return response
        return bytes(body)

    async def _submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        n: int,
        version: int | None,
        stream: bool = False,
    ) -> list[Watch]:
        if request_id in self.inflight:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        loop, changed = asyncio.get_running_loop(), asyncio.Event()
        batcher = self.worker.batcher
        seqs = [
            batcher.new_sequence(
                request_id if n == 1 else f"{request_id}#{i}",
                prompt_ids,
                params,
                index=i,
                version=version,
                stream=stream,
            )
            for i in range(n)
        ]
        watches = [Watch(loop, seq, changed) for seq in seqs]
        self.inflight[request_id] = seqs
        self.worker.call(lambda b: b.add_all(seqs))
        return watches

    async def wait(self, request_id: str, watches: list[Watch]) -> None:
        """Wait until every sequence finished; abort them all if the caller goes away."""
        try:
            for w in watches:
                await w.finished.wait()
        finally:
            self._forget(request_id, watches)

    def _forget(self, request_id: str, watches: list[Watch]) -> None:
        seqs = self.inflight.pop(request_id, [])
        if any(not w.done for w in watches):
            self.worker.call(lambda b: [b.abort(s) for s in seqs if s.finish_reason is None])
        self.recent.add(request_id, [s.completion() for s in seqs])
        if self.request_log is not None:
            with open(self.request_log, "ab") as f:
                for s in seqs:
                    line = {
                        "request_id": s.id,
                        "prompt_ids": list(s.prompt_ids),
                        "token_ids": list(s.token_ids),
                        "versions": list(s.versions),
                        "finish_reason": s.finish_reason,
                    }
                    f.write(msgspec.json.encode(line) + b"\n")

    def _completion_prompt(self, req: api.CompletionRequest) -> list[int]:
        """The prompt's ids; a session call's follow the session's context (sessions.py)."""
        self.sessions.release(req.release_sessions or ())
        req.check_session()
        if req.session_id is None:
            return self._prompt_ids(req.prompt)
        assert not isinstance(req.prompt, str)  # check_session
        return self.sessions.prompt(req.session_id, req.session_extends, req.prompt).tolist()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)  # type: ignore[operator]
        return list(prompt)  # checked against the vocabulary by api.check_prompt

    # -- OpenAI endpoints --------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self.read_body(request, self.max_request_bytes)
        if isinstance(body, web.Response):
            return body
        started = await self._start(body, chat=chat, streamable=True)
        if isinstance(started, web.Response):
            return started
        if started.req.stream:
            return await self._stream(request, started.req, started.meta, started.watches)
        out = await self._finish(started)
        if isinstance(out, web.Response):
            return out
        return wire.answer(out, request, version=out["version"])

    async def _mux(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/mux`: completions over one multiplexed connection (mux.py)."""
        return await mux.serve_mux(request, self._complete_frame, self.controls.allowed(request))

    async def _complete_frame(self, body: bytes) -> tuple[int, bytes]:
        """One call of a multiplexed connection: a completion, answered in msgpack."""
        started = await self._start(body, chat=False, streamable=False)
        out = started if isinstance(started, web.Response) else await self._finish(started)
        if isinstance(out, web.Response):
            return out.status, bytes(cast(bytes, out.body))
        return 200, wire.encode_answer(out)

    async def _start(self, body: bytes, *, chat: bool, streamable: bool) -> _Started | web.Response:
        """Decode and check a generate body, then submit its sequences."""
        req: api.CompletionRequest | api.ChatRequest
        try:
            if chat:
                req = api.decode_strict(body, api.ChatRequest)
                prompt_ids = self._renderer.chat_prompt(
                    req.messages, req.tools, req.add_generation_prompt
                )
            else:
                req = api.decode_strict(body, api.CompletionRequest)
                prompt_ids = self._completion_prompt(req)
            if req.stream and not streamable:
                raise ValueError("the multiplexed connection does not stream: POST the request")
            context, vocab = self.worker.batcher.max_model_len, self.worker.batcher.vocab_size
            api.check_prompt(prompt_ids, vocab, context)
            default_max = context - len(prompt_ids) if chat else 16
            max_tokens = req.max_completion_tokens if isinstance(req, api.ChatRequest) else None
            params = req.sampling_params(max_tokens or max(default_max, 1))
            api.check_sampling(params, vocab)
            request_id = req.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            watches = await self._submit(
                request_id, prompt_ids, params, n=req.n, version=req.version, stream=req.stream
            )
        except UnknownSession as exc:
            return self.error(404, str(exc), kind=wire.UNKNOWN_SESSION)
        except ValueError as exc:
            return self.error(400, str(exc))
        meta = responses.Meta(
            id=request_id,
            model=req.model or self.model_name,
            created=int(time.time()),
            prompt_tokens=len(prompt_ids),
        )
        return _Started(req, meta, watches, prompt_ids)

    async def _finish(self, started: _Started) -> dict[str, Any] | web.Response:
        """Wait for a non-streamed request's sequences; its answer (or error)."""
        req, meta, watches = started.req, started.meta, started.watches
        await self.wait(meta.id, watches)
        failed = next((w.seq for w in watches if w.seq.error), None)
        if failed is not None:
            return self.error(failed.error_status, failed.error or "")
        seqs = [w.seq for w in watches]
        if isinstance(req, api.CompletionRequest) and req.session_id is not None:
            self.sessions.keep(req.session_id, started.prompt_ids, seqs[0].token_ids)
        return (
            self._renderer.chat_response(meta, req, seqs)
            if isinstance(req, api.ChatRequest)
            else (self._renderer.completion_response(meta, req, seqs))
        )

    async def _stream(
        self,
        request: web.Request,
        req: api.CompletionRequest | api.ChatRequest,
        meta: responses.Meta,
        watches: list[Watch],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Dora-Version": str(self.version),
            }
        )
        await response.prepare(request)
        streamer = responses.Streamer(self._renderer, meta, req, [w.seq for w in watches])
        changed = watches[0]._changed
        try:
            while True:
                await changed.wait()
                changed.clear()
                for i, w in enumerate(watches):
                    for chunk in streamer.chunks(i, w.count, w.done):
                        await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
                if all(w.done for w in watches):
                    break
            for chunk in streamer.final():
                await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
        finally:
            self._forget(meta.id, watches)
        return response

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "dora",
            "max_model_len": self.worker.batcher.max_model_len,
            "version": self.version,
        }
        return web.json_response({"object": "list", "data": [card], "version": self.version})

    async def _health(self, request: web.Request) -> web.Response:
        """200 while the engine thread steps its requests; 503 when it is paused
        (`/control/pause`) or stalled: inside one step or command for over `stall_s` seconds
        (weight loads and the idle-policy thread's turns excepted, `EngineWorker.stalled_s`)."""
        worker = self.worker
        stalled_s = worker.stalled_s()
        body: dict[str, object] = {
            "status": "ok",
            "version": self.version,
            "versions": worker.batcher.held_versions(),
            "paused": worker.paused,
            "loading": worker.loading,
            "stalled_s": round(stalled_s, 3),
        }
        if worker.paused:
            problem = "paused (POST /control/pause): it decodes nothing until /control/resume"
            body["status"] = "paused"
        elif stalled_s > self.stall_s:
            problem = (
                f"stalled: the engine thread has been inside one step or command for "
                f"{stalled_s:.1f} s (over {self.stall_s:g} s)"
            )
            body["status"] = "stalled"
        else:
            return web.json_response(body)
        body.update(wire.error_body(503, f"engine {problem}", self.version))
        return web.json_response(body, status=503)

    async def _metrics(self, request: web.Request) -> web.Response:
        stats = await asyncio.wrap_future(self.worker.call(lambda b: b.stats()))
        out: dict[str, object] = {
            "version": self.version,
            "versions": self.worker.batcher.held_versions(),
            "paused": self.worker.paused,
            **stats,
        }
        out["tokens_per_s"] = self.worker.rate()
        return web.json_response(out)


def load_model(
    model_dir: str | Path, dtype: str = "float32", device: str = "cpu"
) -> tuple[torch.nn.Module, object]:
    """The model in `dtype` (`model.dtype`; eval mode) on `device` ("cpu", or "cuda": the
    first GPU this process sees) and its tokenizer. The engine computes wherever the weights are.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"the engine was asked to run on {device!r}, but no CUDA device is visible to it "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r})"
        )
    tok = AutoTokenizer.from_pretrained(model_dir)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)
    )
    return model.to(where).eval(), tok
