"""A small randomly initialised Llama or Qwen2 causal LM built in memory, for unit tests that need
a real model's forward (the engine's fused step, the trainer's packed rows)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def small_lm(arch: str = "llama", **extra: object) -> torch.nn.Module:
    """64 tokens, 2 layers of width 64, 4 heads; `extra` overrides any config field."""
    torch.manual_seed(0)
    common: dict[str, object] = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    common["num_key_value_heads"] = 4  # Qwen2Config's default would be 32
    common.update(extra)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()
