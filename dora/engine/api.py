"""Request bodies of the engine's HTTP API (OpenAI-compatible, plus dora's fields), checked
strictly.

Unknown fields are an error that names every one of them (vLLM ignores them with a warning, which
hides typos such as `max_token`). Bounds are checked by msgspec at decode time. dora's extension
fields:
- `version`: pin the request to a weight version; an instance holding another one answers 409;
- `request_id`: the id that abort and export name (default: a fresh one).

Control bodies travel as JSON, except the two that carry raw bytes (weights, exported requests),
which are msgpack.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec

from dora.protocol import SamplingParams

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
SampleCount = Annotated[int, msgspec.Meta(ge=1, le=256)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]


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
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
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


class RequestIdBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /control/abort and /control/export."""

    request_id: str


class ExportedRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A running request moved between instances of the same version (msgpack).

    `key` and `len(token_ids)` are the whole sampling RNG state (see sampling.py). `kv` holds the
    keys and values of `prompt_ids + token_ids[:-1]` as a `[layers, 2, kv_heads, tokens, head_dim]`
    tensor of `kv_dtype`; empty when the request was still waiting (the importer prefills it).
    """

    request_id: str
    version: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    params: SamplingParams
    key: int
    kv: bytes = b""
    kv_dtype: str = ""
    kv_shape: list[int] = msgspec.field(default_factory=list)


S = TypeVar("S", bound=msgspec.Struct)


def decode_strict(body: bytes, cls: type[S]) -> S:
    """Decode a JSON body into `cls`; unknown fields raise ValueError naming all of them."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError("body must be a JSON object")
    unknown = sorted(set(raw) - set(cls.__struct_fields__))
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from exc
