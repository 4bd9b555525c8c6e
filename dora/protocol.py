"""Wire types: what `dora serve`, the inference instances and `dora learn` say to each other.

Every message is a msgspec Struct. Messages between serve and learn are tagged (`type` field) so one
decoder reads any of them; they travel as msgpack frames over ZeroMQ. Nothing is ever pickled.

Arrays (token ids, logprobs, masks, per-token versions) travel as raw little-endian bytes and are
read with `numpy.frombuffer`, never as lists of Python ints: a 16 x 4096-token group then costs a
few memcpys, not 65,536 boxed integers. `Sample.build` packs them from lists or arrays;
`Sample.tokens()` and friends unpack them without copying.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from dora.errors import EnvError

FinishReason = Literal["stop", "length", "abort", "max_turns", "context", "error"]

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")


def pack(
    values: Sequence[int] | Sequence[float] | npt.NDArray[np.generic], dtype: np.dtype
) -> bytes:
    """Pack a sequence as raw little-endian bytes of `dtype`."""
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def array_bytes(values: array[Any]) -> bytes:
    """A typed array ('i': int32, 'f': float32) as raw little-endian bytes."""
    if sys.byteorder == "little":
        return values.tobytes()
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped.tobytes()


def unpack_array(data: bytes, typecode: Literal["i", "f"]) -> array[Any]:
    """Raw little-endian bytes as a typed array: 'i' for int32, 'f' for float32 (a
    `msgspec.DecodeError` if they are not a whole number of items)."""
    out: array[Any] = array(typecode)
    if len(data) % out.itemsize:
        raise msgspec.DecodeError(
            f"{len(data)} bytes are not a whole number of {out.itemsize}-byte items"
        )
    out.frombytes(data)
    if sys.byteorder != "little":
        out.byteswap()
    return out


def as_array(typecode: str, values: Sequence[int] | Sequence[float]) -> array[Any]:
    """`values` as a typed array: itself if it is one of that type, else a new one. A list is
    converted in one pass (`array(typecode, list)`; `extend(list)` goes item by item, 2.5 times
    slower: a 3,000-token completion takes 0.25 ms vs 0.6 ms)."""
    if isinstance(values, array) and values.typecode == typecode:
        return values
    return array(typecode, values)


def extend_array(into: array[Any], values: Sequence[int] | Sequence[float]) -> None:
    """Append `values` (a list or a typed array) to `into`; an array of its type in one copy."""
    into.extend(as_array(into.typecode, values))


def encode_arrays(obj: object) -> object:
    """msgspec's `enc_hook` for msgpack: a typed array travels as its raw little-endian bytes."""
    if isinstance(obj, array):
        return array_bytes(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def arrays_as_lists(obj: object) -> object:
    """msgspec's `enc_hook` for JSON: a typed array is a list of numbers."""
    if isinstance(obj, array):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


encode_json = msgspec.json.Encoder(enc_hook=arrays_as_lists).encode
"""JSON, with typed arrays as lists of numbers."""
encode_msgpack = msgspec.msgpack.Encoder(enc_hook=arrays_as_lists).encode
"""msgpack, with typed arrays as lists of numbers (the format every instance decodes)."""


MSGPACK = "application/msgpack"
"""The HTTP content type of msgpack bodies between serve and its instances: control calls with
binary payloads (weights, exported requests) and, when the client asks for it (`Accept`), the
completion answers of dora's engine and emulated instances."""


MIN_TEMPERATURE = 1e-4
"""The lowest sampling temperature but 0 (greedy). Below it `logits / T` overflows float32 for
ordinary logits and the behaviour logprobs become NaN; the config and the engine refuse it."""


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to sample one completion. Training rollouts keep top_p = 1 and top_k = -1, so that the
    behaviour logprobs are those the trainer recomputes (docs/engine.md)."""

    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None


class Completion(msgspec.Struct, kw_only=True):
    """What an instance returns for one request (the instance interface, `dora.instance`).

    `token_ids` are the sampled tokens only (not the prompt); `logprobs[i]` is the behaviour
    log-probability of `token_ids[i]`: `log_softmax(logits / T)` over the whole vocabulary;
    `versions[i]` the weight version that sampled it (all equal unless a partial-mode request
    spanned a weight load). `finish_reason` is "abort" when the request was aborted; the tokens so
    far are still returned.

    The three sequences are lists or typed arrays (`array('i')`, `array('f')`, `array('i')`):
    dora's own instances answer in arrays, which cross from the HTTP answer to the episode's
    trajectory as a few memory copies instead of thousands of Python numbers. Compare them with
    `list(...)`: an array never equals a list.
    """

    request_id: str
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    finish_reason: FinishReason
    prompt_tokens: int = 0

    @property
    def version(self) -> int:
        """The version of the first sampled token (the version the request was pinned to)."""
        return self.versions[0] if self.versions else -1


class PackedCompletion(msgspec.Struct, kw_only=True):
    """A `Completion` as dora's instances send it in msgpack (`encode_arrays`): its three arrays
    as raw little-endian bytes. Other fields of the answer are ignored."""

    request_id: str
    token_ids: bytes
    logprobs: bytes
    versions: bytes
    finish_reason: FinishReason
    prompt_tokens: int = 0

    @classmethod
    def of(cls, c: Completion) -> PackedCompletion:
        return cls(
            request_id=c.request_id,
            token_ids=pack(c.token_ids, I32),
            logprobs=pack(c.logprobs, F32),
            versions=pack(c.versions, I32),
            finish_reason=c.finish_reason,
            prompt_tokens=c.prompt_tokens,
        )

    def unpack(self) -> Completion:
        return Completion(
            request_id=self.request_id,
            token_ids=unpack_array(self.token_ids, "i"),
            logprobs=unpack_array(self.logprobs, "f"),
            versions=unpack_array(self.versions, "i"),
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
        )


class Sample(msgspec.Struct, kw_only=True, array_like=True):
    """One trajectory: every turn of one episode as one token sequence.

    `token_ids` holds the prompt and every later token; `loss_mask[i] == 1` exactly for tokens the
    policy sampled; `logprobs[i]` is the behaviour log-probability of token i (0 where the mask is
    0); `versions[i]` the version that sampled token i (-1 where not sampled). `masked` marks a
    sample whose episode failed: it stays in its group (C2) but contributes no gradient.
    """

    token_ids: bytes
    loss_mask: bytes
    logprobs: bytes
    versions: bytes
    prompt_len: int
    reward: float
    reward_components: dict[str, float] = msgspec.field(default_factory=dict)
    finish_reason: FinishReason = "stop"
    masked: bool = False
    num_turns: int = 1
    num_tool_calls: int = 0
    metadata: dict[str, str] = msgspec.field(default_factory=dict)

    @classmethod
    def build(
        cls,
        *,
        token_ids: Sequence[int] | npt.NDArray[np.generic],
        loss_mask: Sequence[int] | npt.NDArray[np.generic],
        logprobs: Sequence[float] | npt.NDArray[np.generic],
        versions: Sequence[int] | npt.NDArray[np.generic],
        prompt_len: int,
        reward: float,
        **fields: object,
    ) -> Sample:
        """Pack arrays into a Sample; all four arrays must have the same length."""
        n = len(token_ids)
        if not (len(loss_mask) == len(logprobs) == len(versions) == n):
            raise ValueError(
                f"sample arrays differ in length: tokens {n}, mask {len(loss_mask)}, "
                f"logprobs {len(logprobs)}, versions {len(versions)}"
            )
        return cls(
            token_ids=pack(token_ids, I32),
            loss_mask=pack(loss_mask, U8),
            logprobs=pack(logprobs, F32),
            versions=pack(versions, I32),
            prompt_len=prompt_len,
            reward=reward,
            **fields,  # type: ignore[arg-type]
        )

    def tokens(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.token_ids, dtype=I32)

    def mask(self) -> npt.NDArray[np.uint8]:
        return np.frombuffer(self.loss_mask, dtype=U8)

    def behaviour_logprobs(self) -> npt.NDArray[np.float32]:
        return np.frombuffer(self.logprobs, dtype=F32)

    def token_versions(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.versions, dtype=I32)

    def sampled_versions(self) -> npt.NDArray[np.int32]:
        """The version of each token the policy sampled (those the loss covers), in order."""
        return self.token_versions()[self.mask() == 1]

    def version_spans(self) -> list[tuple[int, int, int]]:
        """The versions that sampled the trajectory, compactly: `(start, end, version)` with
        every sampled token in positions `[start, end)` sampled by `version`. Tokens the policy
        did not sample (prompt, environment) belong to no span of their own: a span runs on
        across them to the next token of another version. One span unless a trajectory spans
        versions (partial mode)."""
        versions = self.token_versions()
        sampled = np.flatnonzero(versions >= 0)
        if sampled.size == 0:
            return []
        changes = sampled[1:][np.diff(versions[sampled]) != 0]
        starts = [int(sampled[0]), *map(int, changes)]
        ends = [*starts[1:], int(sampled[-1]) + 1]
        return [(a, b, int(versions[a])) for a, b in zip(starts, ends, strict=True)]

    def __len__(self) -> int:
        return len(self.token_ids) // I32.itemsize


class TokenSequence:
    """The growing token sequence of one episode and its per-token arrays, packed into a `Sample`
    at the end: context tokens (the prompt, tool results, replies) with mask 0, log-prob 0 and
    version -1; sampled tokens with mask 1 and the behaviour log-probs and versions the instance
    returned.

    Typed arrays, not lists: thousands of episodes are in flight at once, and the garbage
    collector walks every item of a list (an array is one object to it); they also pack into a
    `Sample` with one copy."""

    def __init__(self) -> None:
        self.ids = array("i")  # a C int: 4 bytes wherever torch runs
        self.mask = array("B")
        self.logprobs = array("f")
        self.versions = array("i")

    def __len__(self) -> int:
        return len(self.ids)

    def add_context(self, ids: Sequence[int]) -> None:
        n = len(ids)
        extend_array(self.ids, ids)
        self.mask.frombytes(bytes(n))
        self.logprobs.frombytes(bytes(4 * n))  # 0.0
        self.versions.extend(array("i", [-1]) * n)

    def add_sampled(self, completion: Completion) -> None:
        check_completion(completion)
        n = len(completion.token_ids)
        extend_array(self.ids, completion.token_ids)
        self.mask.frombytes(b"\x01" * n)
        extend_array(self.logprobs, completion.logprobs)
        extend_array(self.versions, completion.versions)

    def to_sample(self, *, prompt_len: int, reward: float, **fields: object) -> Sample:
        return Sample.build(
            token_ids=self.ids,
            loss_mask=self.mask,
            logprobs=self.logprobs,
            versions=self.versions,
            prompt_len=prompt_len,
            reward=reward,
            **fields,
        )


def check_completion(completion: Completion) -> None:
    """A completion carries one log-prob and one version per sampled token, or `EnvError`."""
    n = len(completion.token_ids)
    if len(completion.logprobs) != n or len(completion.versions) != n:
        raise EnvError(
            f"sampler returned {n} tokens but {len(completion.logprobs)} logprobs and "
            f"{len(completion.versions)} versions"
        )


class Group(msgspec.Struct, kw_only=True, array_like=True):
    """The G samples of one prompt, all generated by `version` (C1) except in partial mode."""

    id: str
    prompt_id: str
    version: int
    samples: list[Sample]
    incarnation: int = 0


# --- serve -> learn -------------------------------------------------------------------------------


class Assigned(msgspec.Struct, tag="assigned", kw_only=True):
    """A completed group assigned to train step `step` by the transfer queue."""

    step: int
    group: Group


class StepClosed(msgspec.Struct, tag="step_closed", kw_only=True):
    """Every group of `step` has been sent; `num_groups` of them."""

    step: int
    num_groups: int


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    """First message on a connection: who is talking and where its state starts."""

    role: Literal["serve", "learn"]
    incarnation: int
    step: int
    token: str = ""


class NcclOpen(msgspec.Struct, tag="nccl_open", kw_only=True):
    """Open NCCL group `generation` for a broadcast to `instances` vLLM servers of
    `tensor_parallel` workers each (`dora.weight_transfer.TransferGroup`): trainer rank 0 answers
    `NcclListening` with where it waits for them, then `NcclDone(version=-1)`."""

    generation: int
    instances: int
    tensor_parallel: int


class NcclBroadcast(msgspec.Struct, tag="nccl_broadcast", kw_only=True):
    """The instances of group `generation` are paused and are receiving `version`: broadcast it
    now (answered by `NcclDone`)."""

    generation: int
    version: int


class Refused(msgspec.Struct, tag="refused", kw_only=True):
    """Serve's answer to a hello that carried the run's token but that serve does not admit:
    why, and the incarnation serve is at (a restart takes the next one)."""

    reason: str
    incarnation: int


# --- learn -> serve -------------------------------------------------------------------------------


class WeightsReady(msgspec.Struct, tag="weights_ready", kw_only=True):
    """Version `version` is published. `path` is a safetensors folder (filesystem transport) or
    empty when the tensors follow inline as `WeightChunk`s."""

    version: int
    incarnation: int
    path: str = ""
    num_chunks: int = 0


class WeightChunk(msgspec.Struct, tag="weight_chunk", kw_only=True):
    """Raw tensors of one version, streamed inline (CPU default transport)."""

    version: int
    index: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    data: list[bytes]


class NcclListening(msgspec.Struct, tag="nccl_listening", kw_only=True):
    """Trainer rank 0 waits for the workers of group `generation` at `address:port`."""

    generation: int
    address: str
    port: int


class NcclDone(msgspec.Struct, tag="nccl_done", kw_only=True):
    """Group `generation` is open (`version` -1) or `version` is broadcast; `error` says why
    not (empty on success)."""

    generation: int
    version: int
    error: str = ""


class StepDone(msgspec.Struct, tag="step_done", kw_only=True):
    """Step `step` is trained; version `step + 1` is published. Carries the step's metrics."""

    step: int
    incarnation: int
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class Durable(msgspec.Struct, tag="durable", kw_only=True):
    """A checkpoint containing step `step` is on disk."""

    step: int
    incarnation: int


class Shutdown(msgspec.Struct, tag="shutdown", kw_only=True):
    """The sender is stopping; `reason` says why."""

    reason: str = ""


ServeMessage = Assigned | StepClosed | Hello | Refused | NcclOpen | NcclBroadcast | Shutdown
LearnMessage = (
    WeightsReady | WeightChunk | StepDone | Durable | Hello | NcclListening | NcclDone | Shutdown
)

_encoder = msgspec.msgpack.Encoder()
_serve_decoder = msgspec.msgpack.Decoder(ServeMessage)
_learn_decoder = msgspec.msgpack.Decoder(LearnMessage)


def encode(message: ServeMessage | LearnMessage) -> bytes:
    """Encode one message as a msgpack frame."""
    return _encoder.encode(message)


def decode_from_serve(frame: bytes) -> ServeMessage:
    """Decode a frame sent by `dora serve`; raises `ProtocolError` if malformed."""
    from dora.errors import ProtocolError

    try:
        return _serve_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed message from dora serve: {exc}") from exc


def decode_from_learn(frame: bytes | memoryview) -> LearnMessage:
    """Decode a frame sent by `dora learn`; raises `ProtocolError` if malformed."""
    from dora.errors import ProtocolError

    try:
        return _learn_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed message from dora learn: {exc}") from exc
