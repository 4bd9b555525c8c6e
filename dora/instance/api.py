"""Request bodies of the engine's HTTP API (OpenAI-compatible, plus dora's fields), checked
strictly.

Unknown fields are an error that names every one of them, with the nearest known field (vLLM
ignores them with a warning, which hides typos such as `max_token` and runs with the default
instead); OpenAI fields the engine does not implement (`presence_penalty`, `logit_bias`, ...) are
refused as unsupported rather than silently ignored, because sampling that differs from what was
asked would skew the behaviour logprobs. dora's own clients send only fields listed here
(tests/integration/engine/test_server.py proves EngineClient's requests decode). A field of the
wrong type or out of bounds is an error naming the field (checked by msgspec at decode time); a
body that is not UTF-8 JSON is an error too. dora's extension fields:
- `version`: pin the request to a weight version; an instance holding another one answers 409;
- `request_id`: the id that abort and export name (default: a fresh one);
- `session_id`, `session_extends`, `release_sessions` (completions with token ids, n = 1): the
  call continues a session, its `prompt` the ids after the session's first `session_extends`
  tokens (dora/instance/session_store.py).

Control bodies travel as JSON, except the two that carry raw bytes (weights, exported requests),
which are msgpack.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Annotated, Literal, TypeVar

import msgspec

# ExportedRequest (a migrated request: the body of `/control/export` and `/control/import`) is
# defined with the interface; the schemas name it beside the routes' other bodies.
from dora.instance.interface import ExportedRequest as ExportedRequest
from dora.protocol import MIN_TEMPERATURE, SamplingParams

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
SampleCount = Annotated[int, msgspec.Meta(ge=1, le=256)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]
"""-1 or 0: off; otherwise the k most likely tokens."""
Seed = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    n: SampleCount = 1
    max_tokens: PositiveInt | None = None
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    """Checked against the vocabulary by the server."""
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    version: int | None = None
    request_id: str | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else -1,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


class CompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/completions."""

    prompt: str | list[int]
    logprobs: NonNegInt | None = None
    echo: Literal[False] = False
    skip_special_tokens: bool = True
    session_id: str | None = None
    """The session this call continues (its context is kept for the next call)."""
    session_extends: NonNegInt = 0
    """How many tokens of the session's context `prompt` follows; 0 starts the session."""
    release_sessions: list[str] | None = None
    """Sessions the client is done with: dropped before this call runs."""

    def check_session(self) -> None:
        """Raise ValueError unless the session fields fit the request."""
        if self.session_id is None:
            if self.session_extends:
                raise ValueError("session_extends needs a session_id")
            return
        if isinstance(self.prompt, str):
            raise ValueError("a session call sends its prompt as token ids")
        if self.n != 1 or self.stream:
            raise ValueError("a session call samples n = 1 and does not stream")
        if not self.prompt and not self.session_extends:
            raise ValueError("prompt is empty: give at least one token")


ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/chat/completions."""

    messages: list[dict[str, object]]
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NonNegInt | None = None
    add_generation_prompt: bool = True

    def __post_init__(self) -> None:
        for i, message in enumerate(self.messages):
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role = {role!r}: expected one of {ROLES}")
            if content is not None and not isinstance(content, str | list):
                raise ValueError(
                    f"messages[{i}].content is {type(content).__name__}: expected a string, a "
                    "list of text parts, or null"
                )
            for j, part in enumerate(content if isinstance(content, list) else []):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(
                        f"messages[{i}].content[{j}] is of type {kind!r}: the engine takes text "
                        'only, as {"type": "text", "text": "..."}'
                    )


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, context: int) -> None:
    """Raise ValueError unless `prompt_ids` is a non-empty prompt of the vocabulary that leaves
    room in the context (max_model_len) for one sampled token."""
    if not prompt_ids:
        raise ValueError("prompt is empty: give at least one token")
    _check_ids("prompt token ids", prompt_ids, vocab_size)
    if len(prompt_ids) >= context:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens does not fit the context of {context} tokens "
            "(max_model_len), which must leave room for one sampled token"
        )


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError naming the first field of `params` the engine cannot sample with: the
    completion routes and `/control/import` both check here, whatever their body's shape."""
    t = params.temperature
    problems = [
        (params.max_tokens < 1, f"max_tokens = {params.max_tokens}: expected at least 1"),
        (params.min_tokens < 0, f"min_tokens = {params.min_tokens}: expected at least 0"),
        (
            not (t == 0.0 or (math.isfinite(t) and t >= MIN_TEMPERATURE)),
            f"temperature = {t!r}: expected 0 (greedy) or at least {MIN_TEMPERATURE:g} "
            "(lower overflows logits / temperature: NaN logprobs)",
        ),
        (not 0.0 < params.top_p <= 1.0, f"top_p = {params.top_p!r}: expected in (0, 1]"),
        (params.top_k < -1, f"top_k = {params.top_k}: expected -1 (off) or at least 0"),
        (
            params.seed is not None and not 0 <= params.seed < 1 << 63,
            f"seed = {params.seed}: expected in [0, 2**63)",
        ),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(message)
    _check_ids("stop_token_ids", params.stop_token_ids, vocab_size)


def check_imported(req: ExportedRequest, vocab_size: int, context: int) -> None:
    """Raise ValueError unless an imported request is one the engine could have exported: its
    prompt and sampling as a completion's (`check_prompt`, `check_sampling`), and what it sampled
    so far consistent (token ids of the vocabulary, one finite log-probability <= 0 and one
    version <= its own per token, fewer tokens than `max_tokens`, a 32-bit noise key)."""
    check_prompt(req.prompt_ids, vocab_size, context)
    check_sampling(req.params, vocab_size)
    n = len(req.token_ids)
    if not 0 <= req.key < 1 << 32:
        raise ValueError(f"key = {req.key}: expected a 32-bit noise key in [0, 2**32)")
    if len(req.logprobs) != n or len(req.versions) != n:
        raise ValueError(
            f"{n} sampled token ids need as many logprobs and versions "
            f"({len(req.logprobs)} and {len(req.versions)} given)"
        )
    _check_ids("sampled token ids", req.token_ids, vocab_size)
    if not all(math.isfinite(x) and x <= 0.0 for x in req.logprobs):
        raise ValueError("logprobs must be finite and at most 0")
    if n and not 0 <= min(req.versions) <= max(req.versions) <= req.version:
        raise ValueError(f"versions must lie in [0, {req.version}] (the request's version)")
    if n >= req.params.max_tokens:
        raise ValueError(f"{n} tokens sampled already: nothing left under max_tokens")
    if len(req.prompt_ids) + n >= context:
        raise ValueError(f"prompt and sampled tokens fill the context of {context} tokens")


def _check_ids(what: str, ids: Sequence[int], vocab_size: int) -> None:
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise ValueError(f"{what} out of range [0, {vocab_size}): {bad[:5]}")


LoadMode = Literal["drain", "abort", "keep"]


class LoadWeightsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /control/load_weights. Either `path` (a safetensors folder) or the raw tensors."""

    version: int
    mode: LoadMode = "drain"
    path: str | None = None
    names: list[str] = msgspec.field(default_factory=list)
    dtypes: list[str] = msgspec.field(default_factory=list)
    shapes: list[list[int]] = msgspec.field(default_factory=list)
    data: list[bytes] = msgspec.field(default_factory=list)


class VersionBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /control/unload_weights: the LoRA adapter version to drop."""

    version: int


class PriorityBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /control/priority: step on the idle-policy thread (True) or the normal one."""

    background: bool


class RequestIdBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /control/abort and /control/export."""

    request_id: str


S = TypeVar("S", bound=msgspec.Struct)


# OpenAI request fields that the engine does not implement; refused by name, never ignored.
UNSUPPORTED = frozenset(
    {
        "best_of",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "presence_penalty",
        "repetition_penalty",
        "response_format",
        "suffix",
    }
)


def decode_strict(body: bytes, cls: type[S]) -> S:
    """Decode a JSON body into `cls`; every problem raises ValueError naming it."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"body is not valid UTF-8 JSON: {exc}") from exc
    except RecursionError:
        raise ValueError("body is nested too deeply to decode") from None
    if not isinstance(raw, dict):
        raise ValueError(f"body must be a JSON object, got {type(raw).__name__}")
    fields = cls.__struct_fields__
    unsupported = sorted(set(raw) & UNSUPPORTED)
    if unsupported:
        raise ValueError(f"unsupported field(s) of the OpenAI API: {', '.join(unsupported)}")
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        named = []
        for name in unknown:
            near = difflib.get_close_matches(name, fields, n=1, cutoff=0.75)
            named.append(f"{name} (did you mean {near[0]}?)" if near else name)
        raise ValueError(f"unknown field(s): {', '.join(named)}")
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from exc
