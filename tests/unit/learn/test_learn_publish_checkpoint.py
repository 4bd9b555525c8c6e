"""Inline weight chunks round-trip exactly; checkpoints and incarnations follow their rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dora.errors import ConfigError
from dora.learn.checkpoint import latest_checkpoint, start_incarnation
from dora.learn.publish import inline_chunks, state_dict_from_chunks
from dora.protocol import WeightChunk, decode_from_learn, encode


def test_inline_chunks_round_trip_through_the_wire() -> None:
    state = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "c": torch.tensor(7, dtype=torch.int64),
        "d": torch.ones(100),
    }
    chunks = inline_chunks(state, version=3, chunk_bytes=64)
    # a (24 B) + b (4 B) + c (8 B) fit 64 bytes; d (400 B) goes alone
    assert [c.names for c in chunks] == [["a", "b", "c"], ["d"]]
    assert [c.index for c in chunks] == [0, 1] and {c.version for c in chunks} == {3}
    wire = [decode_from_learn(encode(c)) for c in reversed(chunks)]  # order does not matter
    assert all(isinstance(c, WeightChunk) for c in wire)
    back = state_dict_from_chunks(c for c in wire if isinstance(c, WeightChunk))
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0)


def test_unknown_dtype_is_refused() -> None:
    chunk = WeightChunk(version=1, index=0, names=["x"], dtypes=["nope"], shapes=[[1]], data=[b""])
    with pytest.raises(ValueError, match="unknown dtype"):
        state_dict_from_chunks([chunk])


def test_incarnations(tmp_path: Path) -> None:
    assert start_incarnation(tmp_path, resume=False) == 0
    assert start_incarnation(tmp_path, resume=True) == 1  # even without a checkpoint
    assert start_incarnation(tmp_path, resume=True) == 2
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints" / "latest").write_text("step-000001\n")
    with pytest.raises(ConfigError, match="--resume"):
        start_incarnation(tmp_path, resume=False)
