"""A tiny model whose answers have long-tailed lengths, for the serve integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dora.models.tiny import TinyModelSpec, build_tiny_model

EOS_BETA = 1.5
"""Logit the end-of-turn token gets on a typical hidden state: a few % per token, so lengths are
roughly geometric with a long tail up to max_tokens (an untrained model would almost never stop)."""


@pytest.fixture(scope="session")
def long_tail_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("serve-model")
    build_tiny_model(out, TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    text = "Compute 1 + 2 - 3\nWrite each partial sum on its own line, then '#### <answer>'."
    ids = tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        u = hidden.mean(0)
        emb = model.get_output_embeddings().weight
        emb[tok.eos_token_id] = EOS_BETA * u / (u @ u)
    model.save_pretrained(out)
    return out
