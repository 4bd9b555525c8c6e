"""ChatRenderer's fast decoding gives exactly the tokenizer's text."""

from __future__ import annotations

import random
from pathlib import Path

from transformers import AutoTokenizer

from dora.models.tiny import TinyModelSpec, build_tiny_model
from dora.serve.episode import ChatRenderer


def test_fast_decode_and_cached_encode_match_the_tokenizer(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=16, num_layers=1))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    renderer = ChatRenderer(tokenizer)
    assert renderer._pieces is not None  # the character model takes the join path
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 300))]
        assert renderer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)
    text = "task 7: the quick brown fox"
    first = renderer.encode(text)
    first.append(-1)  # a caller's change must not reach the cache
    assert renderer.encode(text) == tokenizer.encode(text, add_special_tokens=False)
