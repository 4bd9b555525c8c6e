"""`VllmClient`: the instance interface (`dora.instance`) over one vLLM OpenAI server.

It implements `dora.instance.InstanceClient` itself, over the same `HttpTransport` (deadlines,
error mapping) as the embedded engine's `EngineClient`, so the rollout side drives either backend
and nothing the engine's client does reaches a vLLM server by inheritance. What differs is what
vLLM lacks:

- **Versions.** vLLM's completions carry no weight version, so the client is the authority on the
  version its instance holds: it sets it after each successful load (and mirrors it into vLLM's
  `/update_weight_version` label, so `attach` can read it back). A `generate` pinned to another
  version fails with `VersionMismatch` without reaching the server, as the engine's 409 does.
  This holds because exactly one client (one `dora serve`) drives each instance.
- **Loads.** New generates are held in the client for the whole load; the ones in flight finish
  (`drain`) or are aborted and return their tokens so far (`abort`) → pause → the worker
  extension loads the tensors (`collective_rpc`, see `worker_ext.py`) → prefix cache reset (stale
  KV of the old weights otherwise breaks C1 silently) → version label → resume. So no request is
  sampled under one version and tagged with another. A load that fails leaves the instance at
  version -1, paused: every pinned generate is refused until a load succeeds, because the weights
  may be half-updated.
- **Abort.** `POST /abort_requests` for `cmpl-<request_id>-0`; the in-flight `generate` then
  returns with `finish_reason = "abort"` and the tokens so far, and `abort` returns that same
  completion. The abort is repeated while the request has not returned, which covers the race of an
  abort that reaches vLLM before the request does.
- **Behaviour logprobs** are what the server reports; start it with
  `--logprobs-mode processed_logprobs` (the launcher does) to get `log_softmax(logits / T)`.
- **No KV migration.** `export_request` aborts the request (the router then resubmits the prompt and
  the tokens so far) and raises `RequestError`; `import_request` always raises.
- **No sessions, one version.** Every call sends the whole context (`release_session` has nothing
  to drop); a full-weight instance holds one version, so `unload_weights` is refused without a
  call (`VllmAdapterClient` holds several, as adapters).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import struct
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, TypedDict

import aiohttp
import msgspec

from dora.errors import ConfigError, RequestError, ServerError, ServerTimeout, VersionMismatch
from dora.instance import Capabilities, ExportedRequest
from dora.instance.engine_client import generate_body
from dora.instance.transport import HttpTransport
from dora.protocol import Completion, FinishReason, SamplingParams

__all__ = ["VllmClient", "VllmOptions", "write_safetensors"]

Json = dict[str, object]
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_ABORT_RETRY_S = 0.5
# Prometheus gauge -> key of the engine's /metrics answer
_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


class VllmOptions(TypedDict, total=False):
    """`VllmClient`'s deadlines and connection, for a client built on it that passes them on."""

    timeout_s: float
    control_timeout_s: float
    token: str | None
    session: aiohttp.ClientSession | None


class VllmClient:
    """Talks to one vLLM server at `base_url`, which holds `version` when the client is made."""

    capabilities = Capabilities(kv_migration=False, lora_versions=False)
    """vLLM cannot move a request with its KV cache; this client loads full weights."""

    def __init__(
        self,
        base_url: str,
        *,
        version: int = 0,
        stage_dir: str | None = None,
        timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        """`stage_dir`: a folder this process writes and the server reads (the same host, or a
        shared file system); raw tensors are loaded through a safetensors file there instead of
        base64 JSON over HTTP (which costs a third more bytes and a JSON parse). `timeout_s`:
        a generate's deadline; `control_timeout_s`: a load's or control call's; `session`: the
        caller's aiohttp session (else one of the client's own)."""
        self.http = HttpTransport(base_url, token=token, session=session)
        self.base_url = self.http.base_url
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.version = version
        self.stage_dir = stage_dir
        self.loads = 0
        self._ready = asyncio.Event()
        self._ready.set()
        self._load_lock = asyncio.Lock()
        self._inflight: dict[str, asyncio.Future[Completion]] = {}

    async def __aenter__(self) -> VllmClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.close()

    # -- the instance interface --------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str,
        version: int | None = None,
        timeout_s: float | None = None,
        session: str | None = None,
    ) -> Completion:
        """Sample one completion of `prompt_ids`; `version` pins it (else VersionMismatch).
        vLLM keeps no sessions: `session` is ignored and the whole context travels."""
        await self._ready.wait()  # a load in progress decides which version this request gets
        held = self.version
        if version is not None and version != held:
            raise VersionMismatch(
                f"generate: {self.base_url} holds version {held}, the request needs {version}"
            )
        return await self._complete(prompt_ids, params, request_id, held, timeout_s)

    def release_session(self, session: str) -> None:
        """vLLM keeps no sessions (`capabilities.sessions` is False): nothing to drop."""

    async def _complete(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        version: int,
        timeout_s: float | None,
        *,
        model: str | None = None,
    ) -> Completion:
        """`POST /v1/completions`, tagged `version`; `model` names a LoRA adapter (None: the
        served model)."""
        if request_id in self._inflight:
            raise RequestError(f"generate: request_id {request_id!r} is already in flight")
        body: Json = {
            **generate_body(prompt_ids, params, request_id),  # SamplingParams' names are vLLM's
            # Without it, ids whose text is empty collide in top_logprobs.
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if model is not None:
            body["model"] = model
        done: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._inflight[request_id] = done
        try:
            out = await self.http.post_json(
                "/v1/completions", body, timeout_s or self.timeout_s, "generate"
            )
            completion = _completion(out, request_id, len(prompt_ids), version)
        except BaseException:
            done.cancel()  # an abort waiting on it learns that no completion came back
            raise
        finally:
            del self._inflight[request_id]
        done.set_result(completion)
        return completion

    async def load_weights(
        self,
        version: int,
        *,
        path: str | None = None,
        tensors: Mapping[str, tuple[str, list[int], bytes]] | None = None,
        mode: Literal["drain", "abort", "keep"] = "drain",
        timeout_s: float | None = None,
    ) -> Json:
        """Load `version` from a safetensors folder or file `path` (as seen by the server's host),
        or from raw `tensors` (name -> dtype, shape, bytes). Returns {"version",
        "previous_version", "aborted", "load_s", "worker"}."""
        if (path is None) == (tensors is None):
            raise RequestError("load_weights: give exactly one of path and tensors")
        if mode not in ("drain", "abort"):
            # vLLM's keep mode works, but /v1/completions cannot say which tokens each version
            # sampled; dora's partial mode resumes by resubmission instead.
            raise RequestError(f"load_weights: mode {mode!r} is not supported by vLLM instances")
        if tensors is not None and self.stage_dir is None:
            problem = base64_refusal(sum(len(t[2]) for t in tensors.values()))
            if problem:
                raise ConfigError(problem)
        deadline = timeout_s or self.control_timeout_s
        staged: str | None = None
        if tensors is not None and self.stage_dir is not None:
            staged = os.path.join(
                self.stage_dir, f"dora-v{version}-{uuid.uuid4().hex[:8]}.safetensors"
            )
            await _write_staged(staged, tensors)
            path, tensors = staged, None
        if path is not None:
            rpc: Json = {"method": "dora_load_path", "args": [path]}
        else:
            assert tensors is not None
            rpc = {"method": "dora_load_tensors", "args": [_encode(tensors)]}
        try:
            return await self.load_with(
                version, lambda: self._control("/collective_rpc", rpc, "load"), mode, deadline
            )
        finally:
            if staged is not None:
                await asyncio.to_thread(_remove, staged)

    async def load_with(
        self,
        version: int,
        step: Callable[[], Awaitable[object]],
        mode: str = "drain",
        deadline: float | None = None,
    ) -> Json:
        """Load `version` by `step` (what changes the weights: the worker extension, or vLLM's
        NCCL weight transfer, `dora.vllm.nccl`), with the bookkeeping every load needs: requests
        drained (or aborted), the server paused, the prefix cache reset, the version label set,
        the server resumed; a step that fails leaves the instance paused and unusable."""
        deadline = deadline or self.control_timeout_s
        loop = asyncio.get_running_loop()
        async with self._load_lock:
            self._ready.clear()
            started = loop.time()
            previous = self.version
            # A failed load leaves the server paused on purpose: its weights may be half-updated,
            # and only the next successful load resumes it.
            try:
                async with asyncio.timeout(deadline):
                    running = len(self._inflight)
                    if mode == "abort":
                        await self._abort_all()
                    # Every request this client sent finishes before the weights change, so each
                    # one's tag is exact: a request still on its way to the server when a pause
                    # arrived would otherwise run, after the load, on the new weights.
                    if self._inflight:
                        await asyncio.wait(list(self._inflight.values()))
                    await self._control("/pause?mode=wait", None, "pause")
                    self.version = -1  # the weights are in between until the load succeeds
                    out = await step()
                    reset = await self._control(
                        "/reset_prefix_cache?reset_running_requests=true", None, "prefix reset"
                    )
                    if isinstance(reset, dict) and reset.get("success") is False:
                        raise ServerError(f"load: {self.base_url} did not reset its prefix cache")
                    await self._control(
                        "/update_weight_version", {"new_version": str(version)}, "label"
                    )
                    self.version = version
                    self.loads += 1
                    await self._control("/resume", None, "resume")
            except TimeoutError:
                raise ServerTimeout(
                    f"load: {self.base_url} did not load version {version} within {deadline:g} s"
                ) from None
            finally:
                self._ready.set()
        return {
            "version": version,
            "previous_version": previous,
            "aborted": running if mode == "abort" else 0,
            "load_s": loop.time() - started,
            "worker": out.get("results", []) if isinstance(out, dict) else [],
        }

    async def unload_weights(self, version: int, *, timeout_s: float | None = None) -> Json:
        """Refused without a call: a full-weight instance holds one version
        (`capabilities.lora_versions` is False)."""
        raise RequestError(
            f"unload: {self.base_url} holds one version (full weights, no adapters); "
            f"version {version} is not dropped"
        )

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> Completion:
        """Stop a request; return what it sampled so far (the whole completion if it finished
        meanwhile). A request this client is not running gets `RequestError`."""
        done = self._inflight.get(request_id)
        if done is None:
            raise RequestError(f"abort: request_id {request_id!r} is not in flight")
        body: Json = {"request_ids": [f"cmpl-{request_id}-0"]}
        async with asyncio.timeout(timeout_s or self.control_timeout_s):
            while not done.done():
                await self._control("/abort_requests", body, "abort")
                await asyncio.wait([done], timeout=_ABORT_RETRY_S)
        if done.cancelled():
            raise RequestError(f"abort: request {request_id!r} ended without a completion")
        return done.result()

    async def _abort_all(self) -> None:
        """Abort every request this client has in flight; repeated for those that had not reached
        the server yet."""
        while self._inflight:
            ids = [f"cmpl-{request_id}-0" for request_id in self._inflight]
            await self._control("/abort_requests", {"request_ids": ids}, "abort")
            await asyncio.wait(list(self._inflight.values()), timeout=_ABORT_RETRY_S)

    async def pause(self, *, timeout_s: float | None = None) -> None:
        """Hold new requests on the server; running ones finish first."""
        async with asyncio.timeout(timeout_s or self.control_timeout_s):
            await self._control("/pause?mode=wait", None, "pause")

    async def resume(self, *, timeout_s: float | None = None) -> None:
        async with asyncio.timeout(timeout_s or self.control_timeout_s):
            await self._control("/resume", None, "resume")

    async def export_request(
        self, request_id: str, *, timeout_s: float | None = None
    ) -> ExportedRequest:
        """vLLM cannot export a request's KV cache: abort it (so the caller resubmits its tokens
        so far) and say so."""
        with contextlib.suppress(RequestError):  # not in flight: nothing to stop
            await self.abort(request_id, timeout_s=timeout_s)
        raise RequestError("export: vLLM instances cannot export the KV cache; resubmit instead")

    async def import_request(
        self, exported: ExportedRequest, *, timeout_s: float | None = None
    ) -> Completion:
        raise RequestError("import: vLLM instances cannot import a KV cache; resubmit instead")

    async def health(self, *, timeout_s: float = 5.0) -> Json:
        await self.http.call("GET", "/health", None, None, timeout_s, "health")
        return {"status": "ok", "version": self.version, "paused": not self._ready.is_set()}

    async def metrics(self, *, timeout_s: float = 5.0) -> Json:
        """The engine's keys (running, waiting, kv_usage, version) from vLLM's Prometheus text."""
        raw, _ = await self.http.call("GET", "/metrics", None, None, timeout_s, "metrics")
        out: Json = {"version": self.version, "paused": not self._ready.is_set()}
        for line in raw.decode(errors="replace").splitlines():
            name, _, rest = line.partition("{")
            key = _GAUGES.get(name.strip())
            if key is not None and rest:
                with contextlib.suppress(ValueError):
                    value = float(rest.rsplit(" ", 1)[-1])
                    out[key] = float(out.get(key, 0.0)) + value  # type: ignore[arg-type]
        return out

    async def read_version(self, *, timeout_s: float = 5.0) -> int | None:
        """The version label the server holds (`/weight_info`), if dora set it; None otherwise."""
        raw, _ = await self.http.call("GET", "/weight_info", None, None, timeout_s, "weight info")
        label = msgspec.json.decode(raw).get("weight_version")
        try:
            return int(label)
        except (TypeError, ValueError):
            return None

    # -- transport ---------------------------------------------------------------------------------

    async def control(self, path: str, body: Json | None, what: str) -> object:
        """POST `body` to the server's control route `path` under the control deadline; the
        decoded answer (None when empty). `what` names the call in errors."""
        return await self._control(path, body, what)

    async def _control(self, path: str, body: Json | None, what: str) -> object:
        raw, _ = await self.http.post(path, body, self.control_timeout_s, what)
        return msgspec.json.decode(raw) if raw.strip() else None


def _completion(out: Json, request_id: str, prompt_tokens: int, version: int) -> Completion:
    choice = out["choices"][0]  # type: ignore[index]
    token_ids: list[int] = choice.get("token_ids") or []
    logprobs: list[float] = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(logprobs) != len(token_ids):
        raise ServerError(
            f"generate: {len(token_ids)} tokens but {len(logprobs)} logprobs from vLLM "
            "(was the server started with logprobs enabled?)"
        )
    return Completion(
        request_id=request_id,
        token_ids=token_ids,
        logprobs=logprobs,
        versions=[version] * len(token_ids),
        finish_reason=_FINISH.get(choice.get("finish_reason") or "abort", "stop"),
        prompt_tokens=prompt_tokens,
    )


_SAFETENSORS_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip


def write_safetensors(path: str, tensors: Mapping[str, tuple[str, list[int], bytes]]) -> None:
    """Raw little-endian tensors as a safetensors file (the format is a JSON header and the
    bytes; no torch needed here)."""
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, _, data in tensors.values():
            f.write(data)
    os.replace(path + ".tmp", path)


async def _write_staged(path: str, tensors: Mapping[str, tuple[str, list[int], bytes]]) -> None:
    """Write a staged file on a worker thread. A cancelled caller cannot stop the thread, so the
    file is removed when the write ends instead of lingering in the stage folder."""
    writing = asyncio.get_running_loop().run_in_executor(None, write_safetensors, path, tensors)
    try:
        await asyncio.shield(writing)
    except asyncio.CancelledError:
        writing.add_done_callback(lambda _: _remove(path))
        raise


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


MAX_BASE64_BYTES = 1 << 30
"""Most weight bytes sent as base64 JSON over HTTP (a third more on the wire, parsed whole by the
server): past this a version takes minutes per instance, so it goes through a stage folder."""


def base64_refusal(total_bytes: int) -> str | None:
    """The error for a version of `total_bytes` that would go as base64 over HTTP, or None."""
    if total_bytes <= MAX_BASE64_BYTES:
        return None
    return (
        f"a version of {total_bytes / (1 << 30):.1f} GiB would go to each vLLM server as base64 "
        f"JSON over HTTP (at most {MAX_BASE64_BYTES >> 20} MiB is sent that way): set "
        "serve.stage_dir to a folder dora writes and the servers read (a shared file system "
        "for servers on other nodes)"
    )


def weights_bytes(model_dir: str) -> int:
    """Bytes of the weight files (`*.safetensors`, `*.bin`) in a model folder; 0 if none."""
    folder = Path(model_dir)
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))


def _encode(tensors: Mapping[str, tuple[str, list[int], bytes]]) -> Json:
    """Raw tensors as JSON for `collective_rpc`: names, dtypes, shapes and base64 bytes."""
    return {
        "names": list(tensors),
        "dtypes": [t[0] for t in tensors.values()],
        "shapes": [t[1] for t in tensors.values()],
        "data": [base64.b64encode(t[2]).decode("ascii") for t in tensors.values()],
    }
