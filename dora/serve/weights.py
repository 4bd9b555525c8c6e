"""The weight store: host-memory copies of every policy version `dora serve` may still need.

The trainer publishes version `w` as `WeightChunk`s (raw tensor bytes, the inline transport) or as
a safetensors folder (`WeightsReady.path`, the filesystem transport). The store assembles the
chunks, says when a version is complete, and hands the tensors to an instance that must load it:
the orchestrator may load an *old* version long after its publication (an old version that needs
room for parked requests, an instance that died), so the store cannot simply forward each version
to the instances once.

Invariants:
- a version is `complete` once its `WeightsReady` arrived and all `num_chunks` chunks with it;
  chunks may arrive before or after the `WeightsReady` that announces them;
- messages of an older trainer incarnation are ignored (a ghost version never enters the store),
  and so is a version announced again while the store holds it;
- `retain(keep)` drops every version outside `keep`; the caller keeps the versions that still have
  an unassigned group, a live request, an instance holding them, or that are the newest. Version 0
  is the model folder on disk, so keeping it costs no memory.

The store is plain code (no I/O besides reading a folder path lazily, no asyncio): the rollout
loop calls it from its message handler. Nothing here imports torch: a folder is read as raw bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from dora.errors import ProtocolError
from dora.protocol import WeightChunk, WeightsReady

__all__ = ["VersionWeights", "WeightStore", "read_folder", "read_safetensors_raw"]


@dataclass(slots=True)
class VersionWeights:
    """The weights of one version: a safetensors folder, or raw tensors in host memory."""

    version: int
    incarnation: int
    path: str = ""
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(len(d) for d in self.data)


@dataclass(slots=True)
class _Pending:
    incarnation: int
    num_chunks: int | None = None  # None until WeightsReady arrives
    path: str = ""
    chunks: dict[int, WeightChunk] = field(default_factory=dict)


class WeightStore:
    """Versions by number; see the module docstring."""

    def __init__(self, *, incarnation: int = 0) -> None:
        self._incarnation = incarnation
        self._complete: dict[int, VersionWeights] = {}
        self._pending: dict[int, _Pending] = {}
        self.ignored = 0
        """Messages dropped because they came from an older incarnation."""

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def set_incarnation(self, incarnation: int) -> None:
        """A restarted trainer: versions announced by older incarnations are no longer trusted
        unless already complete (the caller drops ghost versions with `retain`)."""
        if incarnation < self._incarnation:
            raise ProtocolError(f"incarnation {incarnation} is older than {self._incarnation}")
        self._incarnation = incarnation
        self._pending.clear()

    def add_path(self, version: int, path: str, *, incarnation: int = 0) -> None:
        """Register a version that lives in a safetensors folder (version 0: the model folder)."""
        self._complete[version] = VersionWeights(version, incarnation, path=path)

    def on_chunk(self, chunk: WeightChunk, *, incarnation: int | None = None) -> bool:
        """Store one chunk. True if this completed its version. `incarnation` defaults to the
        store's (chunks carry none; they belong to whichever incarnation announces them)."""
        inc = self._incarnation if incarnation is None else incarnation
        if inc < self._incarnation:
            self.ignored += 1
            return False
        if chunk.version in self._complete:
            # Published again (a restarted trainer re-announcing the version it resumes with):
            # the same weights, already here.
            self.ignored += 1
            return False
        if not (len(chunk.names) == len(chunk.dtypes) == len(chunk.shapes) == len(chunk.data)):
            raise ProtocolError(
                f"chunk {chunk.index} of version {chunk.version}: names, dtypes, shapes and data "
                "differ in length"
            )
        pending = self._pending.setdefault(chunk.version, _Pending(inc))
        if chunk.index in pending.chunks:
            raise ProtocolError(f"chunk {chunk.index} of version {chunk.version} arrived twice")
        pending.chunks[chunk.index] = chunk
        return self._try_complete(chunk.version)

    def on_ready(self, ready: WeightsReady) -> bool:
        """`WeightsReady`: True if the version is now complete (False: chunks still missing, or
        the message is from an older incarnation)."""
        if ready.incarnation < self._incarnation:
            self.ignored += 1
            return False
        if ready.incarnation > self._incarnation:
            self.set_incarnation(ready.incarnation)
        if ready.version in self._complete:
            return False  # a repeated announcement changes nothing
        pending = self._pending.setdefault(ready.version, _Pending(ready.incarnation))
        pending.num_chunks = ready.num_chunks
        pending.path = ready.path
        if not ready.path and ready.num_chunks < 1:
            raise ProtocolError(f"version {ready.version} announced with neither path nor chunks")
        return self._try_complete(ready.version)

    def _try_complete(self, version: int) -> bool:
        pending = self._pending[version]
        if pending.num_chunks is None or len(pending.chunks) < pending.num_chunks:
            return False
        if set(pending.chunks) != set(range(pending.num_chunks)):
            raise ProtocolError(
                f"version {version}: chunk indices {sorted(pending.chunks)} are not "
                f"0..{pending.num_chunks - 1}"
            )
        weights = VersionWeights(version, pending.incarnation, path=pending.path)
        for i in range(pending.num_chunks):
            chunk = pending.chunks[i]
            weights.names += chunk.names
            weights.dtypes += chunk.dtypes
            weights.shapes += chunk.shapes
            weights.data += chunk.data
        del self._pending[version]
        self._complete[version] = weights
        return True

    def has(self, version: int) -> bool:
        return version in self._complete

    def get(self, version: int) -> VersionWeights:
        weights = self._complete.get(version)
        if weights is None:
            raise KeyError(
                f"version {version} is not in the weight store (have {sorted(self._complete)})"
            )
        return weights

    def versions(self) -> list[int]:
        return sorted(self._complete)

    def nbytes(self) -> int:
        """Host memory held by complete versions."""
        return sum(w.nbytes for w in self._complete.values())

    def retain(self, keep: set[int]) -> list[int]:
        """Drop every complete version not in `keep`; return the dropped ones."""
        dropped = [w for w in self._complete if w not in keep]
        for w in dropped:
            del self._complete[w]
        return sorted(dropped)


def read_folder(path: str, version: int) -> WeightChunk:
    """Every tensor of a safetensors folder as one chunk (the filesystem transport: the trainer
    prunes old folders, so the store keeps the bytes, not the path). Blocking: run it in a thread.

    The files are read as raw bytes (`read_safetensors_raw`): serve never loads torch, whichever
    transport the trainer uses.
    """
    chunk = WeightChunk(version=version, index=0, names=[], dtypes=[], shapes=[], data=[])
    for name, (dtype, shape, data) in read_safetensors_raw(Path(path)).items():
        chunk.names.append(name)
        chunk.dtypes.append(dtype)
        chunk.shapes.append(shape)
        chunk.data.append(data)
    return chunk


_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
"""safetensors' dtype names -> torch's (the names `WeightChunk.dtypes` carries)."""


def read_safetensors_raw(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """`name -> (dtype, shape, bytes)` of every tensor of every `*.safetensors` file in `folder`,
    files in name order and each file's tensors in the order of their bytes (as
    `safetensors.torch.load_file` gives them). The format: an 8-byte little-endian header
    length, a JSON header of each tensor's dtype, shape and byte range, then the tensors' bytes,
    little-endian and C-contiguous, which is what an instance loads."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    out: dict[str, tuple[str, list[int], bytes]] = {}
    for file in files:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):
                info = header[name]
                if info["dtype"] not in _DTYPES:
                    raise ProtocolError(f"{file}: tensor {name} has unknown dtype {info['dtype']}")
                start, end = info["data_offsets"]
                f.seek(8 + size + start)
                out[name] = (_DTYPES[info["dtype"]], list(info["shape"]), f.read(end - start))
    return out
