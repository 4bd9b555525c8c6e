"""`EngineClient`: the instance interface (`dora.instance.interface`) over one engine's HTTP API.

generate (token ids in; token ids, behaviour logprobs and per-token versions out), load_weights,
abort (returns the tokens so far), health, metrics, and the optional capability export/import
(migration with the KV cache). Its calls go over an `HttpTransport` (`transport.py`: deadlines and
the mapping of failures onto dora.errors; an answer without the fields a call needs is a
ProtocolError too), generate calls over the multiplexed connection where the server has one
(`mux.py`). The client does not retry: the caller owns the retry policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Literal

import aiohttp
import msgspec

from dora.errors import ProtocolError
from dora.instance.callcpu import CALL_CPU
from dora.instance.interface import Capabilities, ExportedRequest
from dora.instance.mux import MuxConnection, MuxRefused
from dora.instance.session import ClientSessions, SessionPlan, SessionUnknown
from dora.instance.transport import HttpTransport, json_object, raise_for
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
        self.http = HttpTransport(base_url, token=token, session=session)
        self.base_url = self.http.base_url
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.sessions = ClientSessions()
        """The episodes' contexts this client's instance holds (`dora.instance.session`)."""
        self.mux = MuxConnection(self.base_url + "/v1/mux", headers=self.http.headers)
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
                raise_for(status, raw, "generate")
            kind = MSGPACK
        else:
            raw, kind = await self.http.call(
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
                self.http.session(), data, timeout_s=timeout_s, what="generate"
            )
        except MuxRefused as exc:
            self.multiplex = False
            log.warning("%s; its calls go over HTTP from now on", exc)
            return None

    def _completion(self, raw: bytes, kind: str, request_id: str, prompt_len: int) -> Completion:
        decode = _first_choice_msgpack if kind == MSGPACK else _first_choice_json
        choice = self.http.decode(raw, "generate", decode)
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
        return await self.http.post_json(
            "/control/load_weights", body, timeout_s or self.control_timeout_s, "load", msgpack=True
        )

    async def unload_weights(self, version: int, *, timeout_s: float | None = None) -> Json:
        """Drop LoRA adapter `version` (embedded engine). Returns {"version", "unloaded",
        "versions"}; `VersionMismatch` (409) while it is the newest or a request still uses it,
        `RequestError` if it is not held."""
        return await self.http.post_json(
            "/control/unload_weights",
            {"version": version},
            timeout_s or self.control_timeout_s,
            "unload",
        )

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> Completion:
        """Stop a request; return what it sampled so far (the whole completion if it finished)."""
        out = await self.http.post_json(
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
        await self.http.post_json(
            "/control/pause", {}, timeout_s or self.control_timeout_s, "pause"
        )

    async def resume(self, *, timeout_s: float | None = None) -> None:
        await self.http.post_json(
            "/control/resume", {}, timeout_s or self.control_timeout_s, "resume"
        )

    async def set_background(self, background: bool, *, timeout_s: float | None = None) -> None:
        """Step on the engine's idle-policy thread (True: only CPU nothing else wants) or on its
        normal one (serve's CPU priority by deadline)."""
        await self.http.post_json(
            "/control/priority",
            {"background": background},
            timeout_s or self.control_timeout_s,
            "priority",
        )

    async def export_request(
        self, request_id: str, *, timeout_s: float | None = None
    ) -> ExportedRequest:
        """Take a running request off this instance, with its sampling state and KV cache."""
        raw, _ = await self.http.post(
            "/control/export",
            {"request_id": request_id},
            timeout_s or self.control_timeout_s,
            "export",
        )
        exported = self.http.decode(raw, "export", _exported_request.decode)
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
        raw, kind = await self.http.call(
            "POST",
            "/control/import",
            encode_msgpack(exported),  # the tokens it holds as arrays travel as lists
            MSGPACK,
            timeout_s or self.timeout_s,
            "import",
            accept=MSGPACK,
        )
        if kind == MSGPACK:
            return self.http.decode(raw, "import", _completion_msgpack.decode).unpack()
        return self.http.decode(raw, "import", _completion.decode)

    async def health(self, *, timeout_s: float = 5.0) -> Json:
        raw, _ = await self.http.call("GET", "/health", None, None, timeout_s, "health")
        return self.http.decode(raw, "health", json_object)

    async def metrics(self, *, timeout_s: float = 5.0) -> Json:
        raw, _ = await self.http.call("GET", "/metrics", None, None, timeout_s, "metrics")
        return self.http.decode(raw, "metrics", json_object)


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
