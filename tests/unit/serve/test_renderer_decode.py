"""ChatRenderer's fast decoding gives exactly the tokenizer's text."""

from __future__ import annotations

import random
from pathlib import Path

from transformers import AutoTokenizer

from dora.episode import ChatRenderer
from dora.models.tiny import TinyModelSpec, build_tiny_model


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


def test_character_encoding_matches_the_tokenizer(tmp_path: Path) -> None:
    """Text of known and unknown characters, whitespace and the chat markers encodes as the
    tokenizer encodes it; plain-text prompts keep their special tokens, and repeat."""
    folder = build_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=16, num_layers=1))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    renderer = ChatRenderer(tokenizer)
    assert renderer._chars is not None  # the character model takes the lookup path
    markers = ["<|im_end|>", "<tool_call>", "<"]
    alphabet = [*"abc xyz019+-=\n\t{}\"'", "é", "中", "\x00", *markers]
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        assert renderer.encode(text) == tokenizer.encode(text, add_special_tokens=False), text
    spec = TinyModelSpec(hidden_size=16, num_layers=1)
    base = ChatRenderer(
        AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "base", spec, base=True))
    )
    prompt = "What is 2 + 3?"
    first = base.prompt_ids(prompt, ())
    assert first == list(base.tokenizer(prompt)["input_ids"])
    assert first[0] == base.tokenizer.bos_token_id
    first.append(-1)  # a caller's change must not reach the cache
    assert base.prompt_ids(prompt, ()) == list(base.tokenizer(prompt)["input_ids"])
