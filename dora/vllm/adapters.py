"""`VllmAdapterClient`: a vLLM server as a multi-version instance, every version a LoRA adapter.

With `model.lora.rank > 0` a version is an adapter over the frozen base (docs/trainer.md), and
vLLM serves several adapters over one base in the same batch. The server is started with
`--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (the launcher does both); then:

- **Names.** Version 0 is the base model (the served model name, no adapter); version `v > 0` is
  the adapter named `dora-v{v}`. A completion pinned to `v` asks for `"model": "dora-v{v}"`, so
  vLLM samples it with that adapter and no other: C1 holds per request, by name.
- **Loads** are `POST /v1/load_lora_adapter` of a peft adapter folder: the filesystem transport
  publishes exactly that; raw tensors (the inline transport) are first written as one into the
  stage folder, kept until the version is unloaded. A load does not pause the server or drain
  its requests: the requests of older versions go on beside the new adapter, which is what makes
  the instance multi-version. No prefix-cache reset either: vLLM keys cached blocks by adapter.
- **Unloads** are `POST /v1/unload_lora_adapter`; the serve side sends one when no lease of the
  version is left. A full-weight load (`attach` resetting a server to version 0) drops every
  adapter first.
- **Held versions** are the client's record (one client drives each instance, as for
  `VllmClient`'s version), reported as `versions` by `health()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from dora.errors import RequestError, ServerError, ServerTimeout, VersionMismatch
from dora.instance import Capabilities
from dora.protocol import Completion, SamplingParams
from dora.vllm.client import VllmClient, VllmOptions, write_safetensors

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["VllmAdapterClient", "adapter_name", "write_adapter_folder"]

Json = dict[str, object]


def adapter_name(version: int) -> str:
    """vLLM's name of version `version`'s adapter."""
    return f"dora-v{version}"


class VllmAdapterClient(VllmClient):
    """Talks to one vLLM server started with `--enable-lora`; holds version 0 (the base) and any
    adapter versions loaded since."""

    capabilities = Capabilities(kv_migration=False, lora_versions=True)

    def __init__(
        self,
        base_url: str,
        *,
        stage_dir: str | None = None,
        **options: Unpack[VllmOptions],
    ) -> None:
        super().__init__(base_url, version=0, stage_dir=stage_dir, **options)
        self.held: set[int] = {0}
        self._staged: dict[int, str] = {}
        """Folders this client wrote adapters to, kept while vLLM may read them again (it reloads
        an adapter it evicted from its cache from the path it was given)."""

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
        """Sample with adapter `version` (the newest held when None); VersionMismatch for a
        version the server does not hold. vLLM keeps no sessions: `session` is ignored and the
        whole context travels."""
        await self._ready.wait()  # a full-weight load in progress
        use = self.version if version is None else version
        if use not in self.held:
            held = ", ".join(map(str, sorted(self.held)))
            raise VersionMismatch(
                f"generate: {self.base_url} holds versions {held}, the request needs {use}"
            )
        model = None if use == 0 else adapter_name(use)
        return await self._complete(prompt_ids, params, request_id, use, timeout_s, model=model)

    async def load_weights(
        self,
        version: int,
        *,
        path: str | None = None,
        tensors: Mapping[str, tuple[str, list[int], bytes]] | None = None,
        mode: Literal["drain", "abort", "keep"] = "keep",
        timeout_s: float | None = None,
    ) -> Json:
        """Load adapter `version` from a peft adapter folder `path` or from its raw `tensors`,
        beside the versions held (any `mode`: nothing running is touched). Version 0 is the base
        model (`attach` resetting a server): a full-weight load of `path` that drops every
        adapter."""
        if (path is None) == (tensors is None):
            raise RequestError("load_weights: give exactly one of path and tensors")
        if version == 0:
            await self._drop_all()
            out = await super().load_weights(version, path=path, mode="drain", timeout_s=timeout_s)
            self.held = {version}
            return out
        deadline = timeout_s or self.control_timeout_s
        loop = asyncio.get_running_loop()
        started, previous = loop.time(), self.version
        try:
            async with asyncio.timeout(deadline):
                if version in self.held:  # the same number, other weights (after a roll-back)
                    await self._unload(version)
                if tensors is not None:
                    path = tempfile.mkdtemp(prefix=f"dora-v{version}-", dir=self.stage_dir)
                    self._staged[version] = path
                    await asyncio.to_thread(write_adapter_folder, path, tensors)
                await self._lora_route(
                    "/v1/load_lora_adapter",
                    {"lora_name": adapter_name(version), "lora_path": path},
                    "load adapter",
                )
        except BaseException as exc:
            staged = self._staged.pop(version, None)
            if staged is not None:  # vLLM holds no adapter from it
                await asyncio.to_thread(shutil.rmtree, staged, True)
            if isinstance(exc, TimeoutError):
                raise ServerTimeout(
                    f"load: {self.base_url} did not load adapter {version} within {deadline:g} s"
                ) from None
            raise
        self.held.add(version)
        self.version = max(self.held)
        self.loads += 1
        return {
            "version": version,
            "previous_version": previous,
            "aborted": 0,
            "load_s": loop.time() - started,
            "versions": sorted(self.held),
        }

    async def unload_weights(self, version: int, *, timeout_s: float | None = None) -> Json:
        """Drop adapter `version`. `RequestError` if it is not held; version 0 (the base) and the
        newest version are kept (`VersionMismatch`), as the embedded engine keeps them."""
        if version not in self.held:
            raise RequestError(f"unload: {self.base_url} does not hold version {version}")
        if version in (0, self.version):
            raise VersionMismatch(f"unload: version {version} is the base or the newest")
        async with asyncio.timeout(timeout_s or self.control_timeout_s):
            await self._unload(version)
        return {"version": self.version, "unloaded": version, "versions": sorted(self.held)}

    async def health(self, *, timeout_s: float = 5.0) -> Json:
        out = await super().health(timeout_s=timeout_s)
        out["versions"] = sorted(self.held)
        return out

    async def _unload(self, version: int) -> None:
        await self._lora_route(
            "/v1/unload_lora_adapter", {"lora_name": adapter_name(version)}, "unload adapter"
        )
        self.held.discard(version)
        staged = self._staged.pop(version, None)
        if staged is not None:
            await asyncio.to_thread(shutil.rmtree, staged, True)

    async def _lora_route(self, path: str, body: Json, what: str) -> None:
        """vLLM's LoRA routes answer with a line of plain text, not JSON; an error is a 4xx/5xx
        (`RequestError`/`ServerError`), as on every route."""
        await self.http.post(path, body, self.control_timeout_s, what)

    async def _drop_all(self) -> None:
        for version in sorted(self.held - {0}):
            with contextlib.suppress(ServerError, RequestError):
                await self._unload(version)
        self.held = {0}


def write_adapter_folder(folder: str, tensors: Mapping[str, tuple[str, list[int], bytes]]) -> None:
    """A peft adapter folder of published adapter tensors (peft's names, the scale folded into
    `B`): `adapter_model.safetensors` and an `adapter_config.json` whose rank and target modules
    are read off the tensors, with `lora_alpha = r` (scale 1)."""
    ranks, targets = set(), set()
    for name, (_, shape, _) in tensors.items():
        parts = name.split(".")
        if "lora_A" in parts:
            ranks.add(shape[0])
            targets.add(parts[parts.index("lora_A") - 1])
    if len(ranks) != 1:
        raise RequestError(f"load: adapter tensors of ranks {sorted(ranks)}, expected one rank")
    [rank] = ranks
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(targets),
        "task_type": "CAUSAL_LM",
    }
    write_safetensors(os.path.join(folder, "adapter_model.safetensors"), tensors)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
