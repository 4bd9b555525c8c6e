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
- `request_id`: the id that abort and export name (default: a fresh one).

Control bodies travel as JSON, except the two that carry raw bytes (weights, exported requests),
which are msgpack.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Literal, TypeVar

import msgspec

# ExportedRequest is the instance interface's (dora.instance); re-exported for the old path.
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

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature = {self.temperature!r}: expected 0 (greedy) or at least "
                f"{MIN_TEMPERATURE:g} (lower overflows logits / temperature: NaN logprobs)"
            )

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
        super().__post_init__()
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
