"""`EngineClient`: the instance interface (`dora.instance.interface`) over one engine's HTTP API.

generate (token ids in; token ids, behaviour logprobs and per-token versions out), load_weights,
abort (returns the tokens so far), health, metrics, and the optional capability export/import
(migration with the KV cache). Every call has a deadline (`asyncio.timeout`). Failures map onto
dora.errors: unreachable -> ServerUnavailable, deadline -> ServerTimeout, 409 -> VersionMismatch,
other 4xx -> RequestError, 5xx -> ServerError; an answer that does not decode (not JSON or msgpack,
or without the fields the call needs) -> ProtocolError. The client does not retry: the caller owns
the retry policy.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Literal, TypedDict, TypeVar

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
from dora.instance.callcpu import CALL_CPU
from dora.instance.interface import Capabilities, ExportedRequest
from dora.instance.mux import MuxConnection, MuxRefused
from dora.instance.session import UNKNOWN_SESSION, ClientSessions, SessionPlan, SessionUnknown
from dora.protocol import (
    MSGPACK,
    Completion,
    FinishReason,
    PackedCompletion,
    SamplingParams,
    as_array,
    encode_json,
    encode_msgpack,
    unpack_array,
)

Json = dict[str, object]
T = TypeVar("T")

log = logging.getLogger("dora.instance")
_completion = msgspec.json.Decoder(Completion)


class _TokenLogprobs(msgspec.Struct):
    token_logprobs: list[float]


class _Choice(msgspec.Struct):
    token_ids: list[int]
    logprobs: _TokenLogprobs
    versions: list[int]
    finish_reason: FinishReason


class _CompletionsAnswer(msgspec.Struct):
    """The fields of a `POST /v1/completions` answer that a Completion takes (others ignored):
    decoded in one typed pass, never as a generic object first."""

    choices: list[_Choice]


class _PackedTokenLogprobs(msgspec.Struct):
    token_logprobs: bytes


class _PackedChoice(msgspec.Struct):
    token_ids: bytes
    logprobs: _PackedTokenLogprobs
    versions: bytes
    finish_reason: FinishReason


class _PackedCompletionsAnswer(msgspec.Struct):
    """`_CompletionsAnswer` in msgpack: the arrays as raw little-endian bytes (`wire.answer`)."""

    choices: list[_PackedChoice]


_completions_answer = msgspec.json.Decoder(_CompletionsAnswer)
_completions_answer_msgpack = msgspec.msgpack.Decoder(_PackedCompletionsAnswer)
_completion_msgpack = msgspec.msgpack.Decoder(PackedCompletion)
"""Completion answers come in msgpack when the server speaks it (dora's engine and emulated
instances: `Accept: application/msgpack`), with the tokens, log-probs and versions as raw bytes
that become typed arrays in one copy each: a 3,000-token completion costs serve about 7 us instead
of 0.3 ms to decode as lists (0.4 ms as JSON) and as much again to turn the lists into arrays."""
_exported_request = msgspec.msgpack.Decoder(ExportedRequest)

_FirstChoice = tuple[Sequence[int], Sequence[float], Sequence[int], FinishReason]
"""A generate answer's first choice: token ids, their log-probs and versions, finish reason."""


def _first_choice_msgpack(raw: bytes) -> _FirstChoice | None:
    choices = _completions_answer_msgpack.decode(raw).choices
    if not choices:
        return None
    c = choices[0]
    return (
        unpack_array(c.token_ids, "i"),
        unpack_array(c.logprobs.token_logprobs, "f"),
        unpack_array(c.versions, "i"),
        c.finish_reason,
    )


def _first_choice_json(raw: bytes) -> _FirstChoice | None:
    choices = _completions_answer.decode(raw).choices
    if not choices:
        return None
    c = choices[0]
    return c.token_ids, c.logprobs.token_logprobs, c.versions, c.finish_reason


KEEPALIVE_S = 120.0
"""How long a client keeps an idle connection for its next call to the same instance."""
SERVER_KEEPALIVE_S = 300
"""How long the servers dora starts keep an idle connection open: longer than `KEEPALIVE_S`, so
that the client, not the server, closes it. A server that closes first races the client's next
call on that connection, which then fails with "Server disconnected"."""


class ClientOptions(TypedDict, total=False):
    """`EngineClient`'s keyword arguments, for a subclass that passes them on unchanged."""

    timeout_s: float
    control_timeout_s: float
    token: str | None
    session: aiohttp.ClientSession | None
    multiplex: bool


class EngineClient:
    """Talks to one engine instance at `base_url` (e.g. `http://127.0.0.1:8000`)."""

    capabilities = Capabilities(kv_migration=True, lora_versions=True, sessions=True)
    """The embedded engine's: it moves requests with their KV cache, holds LoRA versions as
    adapters and keeps sessions. A server of the same API that can do less says so with
    `capabilities=`."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
        capabilities: Capabilities | None = None,
        multiplex: bool = True,
    ) -> None:
        """`multiplex`: generate calls share one long-lived connection (`GET /v1/mux`, the
        embedded engine's and the emulated instances'); False: one HTTP request each."""
        if capabilities is not None:
            self.capabilities = capabilities
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session = session
        self._own_session = session is None
        self.sessions = ClientSessions()
        """The episodes' contexts this client's instance holds (`dora.instance.session`)."""
        self.mux = MuxConnection(self.base_url + "/v1/mux", headers=self._headers)
        self.multiplex = multiplex

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.mux.close()
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

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
        `session` names the episode's session: only the ids new since its last call travel
        (where `capabilities.sessions`; `dora.instance.session`)."""
        CALL_CPU.calls += 1
        plan = (
            self.sessions.plan(session, prompt_ids)
            if session is not None and self.capabilities.sessions
            else None
        )
        try:
            completion = await self._generate(
                prompt_ids, params, request_id, version, timeout_s, plan
            )
        except SessionUnknown:
            assert plan is not None
            plan = self.sessions.whole(plan, prompt_ids)
            completion = await self._generate(
                prompt_ids, params, request_id, version, timeout_s, plan
            )
        if plan is not None:
            self.sessions.keep(plan, completion.token_ids)
        return completion

    def release_session(self, session: str) -> None:
        """The episode is done with this instance (ended, moved or failed): its session is
        dropped here and, with the next call, there."""
        self.sessions.release(session)

    async def _generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        version: int | None,
        timeout_s: float | None,
        plan: SessionPlan | None,
    ) -> Completion:
        started = time.thread_time()
        body = generate_body(prompt_ids if plan is None else plan.new_ids, params, request_id)
        if version is not None:
            body["version"] = version
        if plan is not None:
            body["session_id"] = plan.session
            if plan.extends:
                body["session_extends"] = plan.extends
        released = self.sessions.take_released()
        if released:
            body["release_sessions"] = released
        data = encode_json(body)
        CALL_CPU.add("request", started)
        mux = await self._mux_call(data, timeout_s or self.timeout_s) if self.multiplex else None
        if mux is not None:
            status, raw = mux
            if status >= 400:
                _raise_for(status, raw, "generate")
            kind = MSGPACK
        else:
            raw, kind = await self._call(
                "POST",
                "/v1/completions",
                data,
                "application/json",
                timeout_s or self.timeout_s,
                "generate",
                accept=MSGPACK,
            )
        started = time.thread_time()
        try:
            return self._completion(raw, kind, request_id, len(prompt_ids))
        finally:
            CALL_CPU.add("answer", started)

    async def _mux_call(self, data: bytes, timeout_s: float) -> tuple[int, bytes] | None:
        """One generate over the multiplexed connection: (status, body); None once the address
        refused the connection's upgrade (`MuxRefused`): this client sends over HTTP from then
        on, logged once."""
        try:
            return await self.mux.call(
                self._client_session(), data, timeout_s=timeout_s, what="generate"
            )
        except MuxRefused as exc:
            self.multiplex = False
            log.warning("%s; its calls go over HTTP from now on", exc)
            return None

    def _completion(self, raw: bytes, kind: str, request_id: str, prompt_len: int) -> Completion:
        decode = _first_choice_msgpack if kind == MSGPACK else _first_choice_json
        choice = self._decode(raw, "generate", decode)
        if choice is None:
            raise ProtocolError(f"generate: {self.base_url} answered with no completion choice")
        token_ids, logprobs, versions, finish_reason = choice
        return Completion(
            request_id=request_id,
            token_ids=token_ids,
            logprobs=logprobs,
            versions=versions,
            finish_reason=finish_reason,
            prompt_tokens=prompt_len,
        )

    async def load_weights(
        self,
        version: int,
        *,
        path: str | None = None,
        tensors: Mapping[str, tuple[str, list[int], bytes]] | None = None,
        mode: Literal["drain", "abort", "keep"] = "drain",
        timeout_s: float | None = None,
    ) -> Json:
        """Load `version` from a safetensors folder `path`, or from raw `tensors` (name -> dtype,
        shape, bytes). Returns {"version", "previous_version", "aborted", "load_s"} (the embedded
        engine adds "versions": every version it holds; a LoRA adapter is held beside them)."""
        body: Json = {"version": version, "mode": mode}
        if path is not None:
            body["path"] = path
        if tensors is not None:
            body.update(
                names=list(tensors),
                dtypes=[t[0] for t in tensors.values()],
                shapes=[t[1] for t in tensors.values()],
                data=[t[2] for t in tensors.values()],
            )
        return await self._post(
            "/control/load_weights", body, timeout_s or self.control_timeout_s, "load", msgpack=True
        )

    async def unload_weights(self, version: int, *, timeout_s: float | None = None) -> Json:
        """Drop LoRA adapter `version` (embedded engine). Returns {"version", "unloaded",
        "versions"}; `VersionMismatch` (409) while it is the newest or a request still uses it,
        `RequestError` if it is not held."""
        return await self._post(
            "/control/unload_weights",
            {"version": version},
            timeout_s or self.control_timeout_s,
            "unload",
        )

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> Completion:
        """Stop a request; return what it sampled so far (the whole completion if it finished)."""
        out = await self._post(
            "/control/abort",
            {"request_id": request_id},
            timeout_s or self.control_timeout_s,
            "abort",
        )
        try:
            return msgspec.convert(out["completions"][0], Completion, strict=False)  # type: ignore[index]
        except (KeyError, IndexError, TypeError, msgspec.ValidationError) as exc:
            raise ProtocolError(
                f"abort: {self.base_url} answered without a valid completion: {exc!r}"
            ) from exc

    async def pause(self, *, timeout_s: float | None = None) -> None:
        await self._post("/control/pause", {}, timeout_s or self.control_timeout_s, "pause")

    async def resume(self, *, timeout_s: float | None = None) -> None:
        await self._post("/control/resume", {}, timeout_s or self.control_timeout_s, "resume")

    async def set_background(self, background: bool, *, timeout_s: float | None = None) -> None:
        """Step on the engine's idle-policy thread (True: only CPU nothing else wants) or on its
        normal one (serve's CPU priority by deadline)."""
        await self._post(
            "/control/priority",
            {"background": background},
            timeout_s or self.control_timeout_s,
            "priority",
        )

    async def export_request(
        self, request_id: str, *, timeout_s: float | None = None
    ) -> ExportedRequest:
        """Take a running request off this instance, with its sampling state and KV cache."""
        raw, _ = await self._call(
            "POST",
            "/control/export",
            msgspec.json.encode({"request_id": request_id}),
            "application/json",
            timeout_s or self.control_timeout_s,
            "export",
        )
        exported = self._decode(raw, "export", _exported_request.decode)
        return msgspec.structs.replace(
            exported,
            prompt_ids=as_array("i", exported.prompt_ids),
            token_ids=as_array("i", exported.token_ids),
            logprobs=as_array("f", exported.logprobs),
            versions=as_array("i", exported.versions),
        )

    async def import_request(
        self, exported: ExportedRequest, *, timeout_s: float | None = None
    ) -> Completion:
        """Continue an exported request here; returns its whole completion once it finishes."""
        raw, kind = await self._call(
            "POST",
            "/control/import",
            encode_msgpack(exported),  # the tokens it holds as arrays travel as lists
            MSGPACK,
            timeout_s or self.timeout_s,
            "import",
            accept=MSGPACK,
        )
        if kind == MSGPACK:
            return self._decode(raw, "import", _completion_msgpack.decode).unpack()
        return self._decode(raw, "import", _completion.decode)

    async def health(self, *, timeout_s: float = 5.0) -> Json:
        raw, _ = await self._call("GET", "/health", None, None, timeout_s, "health")
        return self._decode(raw, "health", _json_object)

    async def metrics(self, *, timeout_s: float = 5.0) -> Json:
        raw, _ = await self._call("GET", "/metrics", None, None, timeout_s, "metrics")
        return self._decode(raw, "metrics", _json_object)

    # -- transport ---------------------------------------------------------------------------------

    async def _post(
        self, path: str, body: Json, timeout_s: float, what: str, *, msgpack: bool = False
    ) -> Json:
        raw, _ = await self._post_raw(path, body, timeout_s, what, msgpack=msgpack)
        return self._decode(raw, what, _json_object)

    async def _post_raw(
        self,
        path: str,
        body: Json,
        timeout_s: float,
        what: str,
        *,
        msgpack: bool = False,
        accept: str | None = None,
    ) -> tuple[bytes, str]:
        """POST `body` as JSON (msgpack with `msgpack`), asking for the answer in `accept`; the
        answer's bytes and content type."""
        if msgpack:
            data, content_type = encode_msgpack(body), MSGPACK
        else:
            data, content_type = encode_json(body), "application/json"
        return await self._call("POST", path, data, content_type, timeout_s, what, accept=accept)

    def _decode(self, raw: bytes, what: str, decode: Callable[[bytes], T]) -> T:
        try:
            return decode(raw)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise ProtocolError(
                f"{what}: {self.base_url} answered with a body that does not decode: {exc} "
                f"({raw[:80]!r})"
            ) from exc

    async def _call(
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
        answer's bytes and content type. An error status raises (see the module docstring)."""
        session = self._client_session()
        headers = dict(self._headers)
        if content_type:
            headers["Content-Type"] = content_type
        if accept:
            headers["Accept"] = accept
        url = self.base_url + path
        payload = (
            io.BytesIO(data) if data is not None and len(data) > 1 << 20 else data
        )  # big bodies stream
        try:
            async with asyncio.timeout(timeout_s):
                async with session.request(method, url, data=payload, headers=headers) as resp:
                    raw = await resp.read()
                    status = resp.status
                    kind = resp.content_type
        except TimeoutError as exc:
            raise ServerTimeout(f"{what}: no answer from {url} within {timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise ServerUnavailable(f"{what}: {url} unreachable: {exc}") from exc
        if status >= 400:
            _raise_for(status, raw, what)
        return raw, kind

    def _client_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No pool limit (aiohttp's default is 100 connections): serve's admission already
            # bounds the calls to an instance (vLLM's max_num_seqs is 256), a capped pool would
            # queue them here, unseen by the instance, while the router counts them as running,
            # and a health probe must never queue behind long calls. Idle connections are kept
            # through a training phase, so the next step's calls do not reconnect. Every call has
            # its own deadline (asyncio.timeout below): no second timer per call.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session


def _raise_for(status: int, raw: bytes, what: str) -> None:
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


def generate_body(prompt_ids: Sequence[int], params: SamplingParams, request_id: str) -> Json:
    """The body of `POST /v1/completions` that every backend of this API takes: token ids in;
    token ids and the sampled tokens' logprobs out."""
    return {
        "prompt": prompt_ids,
        "request_id": request_id,
        **msgspec.structs.asdict(params),  # the server's sampling fields, same names
        "logprobs": 0,
        "return_token_ids": True,
    }


def _json_object(raw: bytes) -> Json:
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
