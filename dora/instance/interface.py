"""The instance interface: what `dora serve` needs from one inference instance, whatever runs it.

An instance is one inference server holding one weight version at a time (the embedded engine, a
vLLM server, or any future backend). Serve drives every backend through `InstanceClient`: generate
(token ids in; token ids, behaviour log-probs and per-token versions out, pinned to a version so
that an instance holding another one refuses with `VersionMismatch` rather than sample), load a
version, abort (returns the tokens so far), health, and the optional KV-migration capability
(export a running request with its KV cache, import it on another instance of the same version).
Each client declares what its backend can do as `Capabilities`, and serve asks that instead of
the backend's name. A backend without KV migration raises `RequestError` from
`export_request`/`import_request`, and serve falls back to abort plus resubmission of the prompt
and the tokens so far; serve's tests pass with `kv_migration = false` too.

An adapter-capable backend (the embedded engine or a vLLM server with LoRA versions) holds several
versions at once, reports them as `versions` in its `health()` answer and drops one with
`unload_weights`; `held_versions` reads that answer for any backend (one that reports only
`version` holds that one).

This module and its package import neither torch nor any backend: the vLLM client and serve use it
without loading the embedded engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import msgspec

from dora.protocol import Completion, SamplingParams

__all__ = [
    "Capabilities",
    "ExportedRequest",
    "InstanceClient",
    "InstanceHandle",
    "SetBackground",
    "common_capabilities",
    "held_versions",
]


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What one backend's instances can do beyond generate, load, abort and health."""

    kv_migration: bool
    """`export_request`/`import_request` move a running request with its KV cache to another
    instance of the same version."""
    lora_versions: bool
    """With LoRA versions (`model.lora.rank > 0`), an instance holds several versions at once as
    adapters over one base, reports them as `versions` in `health()`, and drops one with
    `unload_weights`."""
    sessions: bool = False
    """`generate(..., session=...)` sends only the ids new since the session's last call: the
    instance keeps each episode's context (`dora.instance.session`); without it every call
    sends the whole context."""


def common_capabilities(clients: Sequence[InstanceClient]) -> Capabilities:
    """What every one of `clients` can do (serve plans for the pool as a whole)."""
    return Capabilities(
        kv_migration=all(c.capabilities.kv_migration for c in clients),
        lora_versions=all(c.capabilities.lora_versions for c in clients),
        sessions=all(c.capabilities.sessions for c in clients),
    )


class ExportedRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A running request moved between instances of the same version (msgpack).

    `key` and `len(token_ids)` are the whole sampling RNG state (see dora/engine/sampling.py). `kv`
    holds the keys and values of `prompt_ids + token_ids[:-1]` as a `[layers, 2, kv_heads, tokens,
    head_dim]` tensor of `kv_dtype`; empty when the request was still waiting (the importer
    prefills it).

    On the wire the four token arrays are lists of numbers; decoded by an instance they are lists,
    and the client (`EngineClient.export_request`) holds them as typed arrays: an exported request
    of the long tail carries tens of thousands of tokens and may wait seconds for its import, and
    the garbage collector walks every item of a list but sees an array as one object.
    """

    request_id: str
    version: int
    prompt_ids: Sequence[int]
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    params: SamplingParams
    key: int
    kv: bytes = b""
    kv_dtype: str = ""
    kv_shape: list[int] = msgspec.field(default_factory=list)


class InstanceClient(Protocol):
    """One instance, as serve and the episode runner call it (`EngineClient`, `VllmClient`).

    `timeout_s=None` means the client's own default deadline; every call has one.
    """

    @property
    def capabilities(self) -> Capabilities:
        """What this instance can do (KV migration, several LoRA versions at once)."""
        ...

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
        """Sample one completion of `prompt_ids` (new tokens only); `version` pins it. `session`
        (where `capabilities.sessions`) names the episode's context on the instance, so that only
        what is new since its last call travels."""
        ...

    def release_session(self, session: str) -> None:
        """The episode is done with this instance: drop its session (no call of its own)."""
        ...

    async def load_weights(
        self,
        version: int,
        *,
        path: str | None = None,
        tensors: Mapping[str, tuple[str, list[int], bytes]] | None = None,
        mode: Literal["drain", "abort", "keep"] = "drain",
        timeout_s: float | None = None,
    ) -> dict[str, object]:
        """Load `version` from a safetensors folder `path` or from raw `tensors` (name -> dtype,
        shape, bytes). `mode`: running requests finish first ("drain"), end now ("abort"), or go
        on under the new weights with their KV cache ("keep"; a backend may refuse it)."""
        ...

    async def unload_weights(
        self, version: int, *, timeout_s: float | None = None
    ) -> dict[str, object]:
        """Drop the adapter of `version` (only where `capabilities.lora_versions`)."""
        ...

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> Completion:
        """Stop a request; return what it sampled so far."""
        ...

    async def export_request(
        self, request_id: str, *, timeout_s: float | None = None
    ) -> ExportedRequest:
        """Take a running request off this instance, with its KV cache (optional capability)."""
        ...

    async def import_request(
        self, exported: ExportedRequest, *, timeout_s: float | None = None
    ) -> Completion:
        """Continue an exported request here; its whole completion once it finishes."""
        ...

    async def health(self, *, timeout_s: float = 5.0) -> dict[str, object]: ...

    async def close(self) -> None: ...


SetBackground = Callable[[bool], Awaitable[None]]
"""Moves an engine's model to its idle-policy thread (True) or back (False):
`EngineClient.set_background` (`dora.serve.cpu_priority`)."""


@dataclass(eq=False, kw_only=True)
class InstanceHandle:
    """One started instance: its id, URL, client, and how to stop it (the process or server
    context that started it; never a search by name)."""

    id: str
    url: str
    client: InstanceClient
    stop: Callable[[], Awaitable[None]]
    set_background: SetBackground | None = None
    """Moves the instance's model to its idle-policy thread (True) and back, where serve started
    an embedded engine process on this machine (`dora.serve.cpu_priority`)."""


def held_versions(health: Mapping[str, object]) -> list[int]:
    """The versions an instance may be pinned to, from its `health()` answer: `versions` where
    the backend reports several (LoRA adapters beside the base), else its one `version`."""
    versions = health.get("versions")
    if isinstance(versions, list) and all(isinstance(v, int) for v in versions) and versions:
        return sorted(versions)
    version = health.get("version")
    if not isinstance(version, int):
        raise ValueError(f"health answer without an integer version: {dict(health)!r}")
    return [version]
