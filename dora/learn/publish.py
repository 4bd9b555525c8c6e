"""Publishing version `t + 1` to `dora serve` after step `t`.

Two transports (`learn.weight_transport`):
- `filesystem` (the reference): a Hugging Face folder per version,
  `{run_dir}/weights/v{version:06d}` (config.json + model.safetensors, loadable by transformers
  and vLLM), written to a temporary name and renamed, so a reader never sees half a version.
  `WeightsReady.path` is its absolute path. With LoRA (`model.lora.rank > 0`) a version is its
  adapter only (`dora.learn.lora`): a peft adapter folder, or chunks of the adapter tensors.
  Folders older than `version - K - 2` are pruned: serve copies a version into its host-memory
  weight store when `WeightsReady` arrives, and no group older than `t - K` can still be assigned.
- `inline` (CPU default): the tensors themselves, as `WeightChunk` messages of raw little-endian
  bytes (names, dtypes such as "float32", shapes), at most `INLINE_CHUNK_BYTES` per chunk, then
  `WeightsReady(path="", num_chunks=n)`. Every key of the model's state dict is sent, tied weights
  included, so `load_state_dict(strict=True)` works. `state_dict_from_chunks` reads them back.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from dora.protocol import WeightChunk

INLINE_CHUNK_BYTES = 32 << 20  # one msgpack frame stays far below ZMQ's and msgspec's comfort


def version_dir(run_dir: Path, version: int) -> Path:
    return run_dir / "weights" / f"v{version:06d}"


def publish_filesystem(
    model: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    run_dir: Path,
    version: int,
    keep_from: int,
    adapter_of: str | None = None,
) -> Path:
    """Write version `version` as a HF folder (atomically) and prune versions below `keep_from`.
    With `adapter_of` (the base model's path), `state_dict` holds a LoRA version's published
    tensors (`dora.learn.lora.adapter_tensors`) and the folder is a peft adapter folder."""
    final = version_dir(run_dir, version)
    tmp = final.with_name(f".{final.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if adapter_of is not None:
        from dora.learn.lora import save_published_adapter

        save_published_adapter(tmp, state_dict, base_model=adapter_of)
    else:
        model.save_pretrained(tmp, state_dict=dict(state_dict))  # type: ignore[operator]
    if final.exists():  # a restarted trainer re-publishes a version number: the new one wins
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in final.parent.glob("v*"):
        if old.name[1:].isdigit() and int(old.name[1:]) < keep_from:
            shutil.rmtree(old, ignore_errors=True)
    return final.resolve()


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def inline_chunks(
    state_dict: Mapping[str, torch.Tensor], *, version: int, chunk_bytes: int = INLINE_CHUNK_BYTES
) -> list[WeightChunk]:
    """The state dict as `WeightChunk`s of at most `chunk_bytes` (a bigger tensor goes alone)."""
    chunks: list[WeightChunk] = []
    current = WeightChunk(version=version, index=0, names=[], dtypes=[], shapes=[], data=[])
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current.names and size + nbytes > chunk_bytes:
            chunks.append(current)
            current = WeightChunk(
                version=version, index=len(chunks), names=[], dtypes=[], shapes=[], data=[]
            )
            size = 0
        current.names.append(name)
        current.dtypes.append(str(tensor.dtype).removeprefix("torch."))
        current.shapes.append(list(tensor.shape))
        current.data.append(_raw(tensor))
        size += nbytes
    if current.names:
        chunks.append(current)
    return chunks


def state_dict_from_chunks(chunks: Iterable[WeightChunk]) -> dict[str, torch.Tensor]:
    """Rebuild the tensors of one version from its chunks (what serve does on `WeightsReady`)."""
    out: dict[str, torch.Tensor] = {}
    for chunk in sorted(chunks, key=lambda c: c.index):
        for name, dtype, shape, data in zip(
            chunk.names, chunk.dtypes, chunk.shapes, chunk.data, strict=True
        ):
            torch_dtype = getattr(torch, dtype, None)
            if not isinstance(torch_dtype, torch.dtype):
                raise ValueError(f"weight chunk {chunk.index}: unknown dtype {dtype!r} for {name}")
            buf = torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))
            out[name] = buf.view(torch_dtype).reshape(shape)
    return out
