"""The weight store: chunk assembly in any order, incarnations, eviction, folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dora.errors import ProtocolError
from dora.protocol import WeightChunk, WeightsReady
from dora.serve.weights import WeightStore, read_folder


def _chunk(version: int, index: int, name: str, nbytes: int = 8) -> WeightChunk:
    return WeightChunk(
        version=version,
        index=index,
        names=[name],
        dtypes=["float32"],
        shapes=[[nbytes // 4]],
        data=[bytes(nbytes)],
    )


def test_chunks_then_ready_and_ready_then_chunks() -> None:
    store = WeightStore()
    assert not store.on_chunk(_chunk(1, 0, "a"))
    assert not store.on_chunk(_chunk(1, 1, "b"))
    assert store.on_ready(WeightsReady(version=1, incarnation=0, num_chunks=2))
    w = store.get(1)
    assert w.names == ["a", "b"] and w.nbytes == 16
    assert not store.on_ready(WeightsReady(version=2, incarnation=0, num_chunks=2))
    assert not store.on_chunk(_chunk(2, 1, "b"))
    assert store.on_chunk(_chunk(2, 0, "a"))
    assert store.get(2).names == ["a", "b"], "chunks are joined in index order"
    assert store.versions() == [1, 2] and store.nbytes() == 32
    # announced again (a restarted trainer): ignored, the weights stay
    assert not store.on_chunk(_chunk(2, 0, "a"))
    assert not store.on_ready(WeightsReady(version=2, incarnation=0, num_chunks=2))
    assert store.get(2).names == ["a", "b"] and store.ignored == 1


def test_bad_chunks_are_protocol_errors() -> None:
    store = WeightStore()
    store.on_chunk(_chunk(1, 0, "a"))
    with pytest.raises(ProtocolError, match="twice"):
        store.on_chunk(_chunk(1, 0, "a"))
    store.on_chunk(_chunk(1, 5, "b"))
    with pytest.raises(ProtocolError, match=r"not 0\.\.1"):
        store.on_ready(WeightsReady(version=1, incarnation=0, num_chunks=2))
    bad = WeightChunk(version=3, index=0, names=["a"], dtypes=[], shapes=[], data=[])
    with pytest.raises(ProtocolError, match="differ in length"):
        store.on_chunk(bad)
    with pytest.raises(ProtocolError, match="neither path nor chunks"):
        store.on_ready(WeightsReady(version=4, incarnation=0))


def test_older_incarnations_are_ignored() -> None:
    store = WeightStore()
    store.on_chunk(_chunk(3, 0, "a"))
    assert not store.on_ready(WeightsReady(version=3, incarnation=1, num_chunks=2))
    # a new incarnation forgets half-received versions of the old one
    assert not store.on_chunk(_chunk(3, 1, "b"))
    assert not store.on_ready(WeightsReady(version=9, incarnation=0, num_chunks=1))
    assert store.ignored == 1 and store.incarnation == 1


def test_retain_and_paths(tmp_path: Path) -> None:
    store = WeightStore()
    store.add_path(0, str(tmp_path))
    for v in (1, 2, 3):
        store.on_chunk(_chunk(v, 0, "a"))
        store.on_ready(WeightsReady(version=v, incarnation=0, num_chunks=1))
    assert store.retain({0, 3}) == [1, 2]
    assert store.versions() == [0, 3] and store.get(0).path == str(tmp_path)
    with pytest.raises(KeyError, match="not in the weight store"):
        store.get(1)


def test_read_folder_round_trip(tmp_path: Path) -> None:
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    chunk = read_folder(str(tmp_path), 4)
    assert chunk.version == 4 and sorted(chunk.names) == ["b", "w"]
    i = chunk.names.index("w")
    assert chunk.shapes[i] == [2, 3] and chunk.dtypes[i] == "float32"
    back = torch.frombuffer(bytearray(chunk.data[i]), dtype=torch.float32).reshape(2, 3)
    assert torch.equal(back, tensors["w"])


def test_read_folder_gives_the_bytes_torch_would(tmp_path: Path) -> None:
    """Every dtype a model ships in, over two files, as raw bytes equal to torch's own; a
    bfloat16 tensor has no numpy dtype, so only its bytes can carry it."""
    first = {
        "z.bf16": torch.randn(3, 5).to(torch.bfloat16),
        "a.half": torch.randn(4).to(torch.float16),
        "ids": torch.arange(7, dtype=torch.int64),
    }
    second = {"m.f32": torch.randn(2, 2, 2), "flag": torch.tensor([True, False])}
    save_file(first, str(tmp_path / "model-00001.safetensors"), metadata={"format": "pt"})
    save_file(second, str(tmp_path / "model-00002.safetensors"))
    chunk = read_folder(str(tmp_path), 7)
    expected = {**first, **second}
    by_torch = [
        *load_file(tmp_path / "model-00001.safetensors"),
        *load_file(tmp_path / "model-00002.safetensors"),
    ]
    assert chunk.names == by_torch
    for name, dtype, shape, data in zip(
        chunk.names, chunk.dtypes, chunk.shapes, chunk.data, strict=True
    ):
        tensor = expected[name]
        assert dtype == str(tensor.dtype).removeprefix("torch.")
        assert shape == list(tensor.shape)
        assert data == tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


SERVE_READS_A_FOLDER = """
import sys
import dora.serve.main  # the `dora serve` command and everything it imports
from dora.protocol import WeightsReady
from dora.serve.weights import WeightStore, read_folder

store = WeightStore()
store.on_chunk(read_folder(sys.argv[1], 3))  # as the trainer link does on a folder's WeightsReady
store.on_ready(WeightsReady(version=3, incarnation=0, num_chunks=1))
weights = store.get(3)
print(*weights.names, *(m for m in ("torch", "safetensors.torch") if m in sys.modules))
"""


def test_serve_takes_a_weights_folder_without_importing_torch(tmp_path: Path) -> None:
    """With the filesystem transport serve reads each published folder into its store; the
    instances load it, so serve (which may drive vLLM from a small process) never needs torch."""
    save_file({"w": torch.ones(2, 3), "b": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    out = subprocess.run(
        [sys.executable, "-c", SERVE_READS_A_FOLDER, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["b", "w"]
