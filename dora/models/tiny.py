"""Tiny causal LMs with a character tokenizer, built from a config, fully offline.

Tests and the examples need a real model that trains in seconds on two CPU cores and never touches
the network. `build_tiny_model` writes an ordinary Hugging Face folder (config, safetensors weights,
tokenizer, chat template) that transformers, the embedded engine and vLLM all load like any other
model.

The tokenizer maps every character to one token (`tokenizers` WordLevel over single characters,
split with the regex `[\\s\\S]` because Oniguruma's `.` does not match a newline). A few chat
markers are single special tokens, so the chat template's structure costs one token each, and
`<|im_end|>` is the end of turn the model learns to emit. The chat template is ChatML with
hermes-style tools: tool schemas are listed in the system turn, the assistant calls a tool with
`<tool_call>{json}</tool_call>`, and results come back in `tool` turns. Because every character is a
token, rendering a conversation and tokenizing it is exactly the concatenation of the rendered
pieces, which keeps token-in-token-out episodes exact.

`base=True` builds what many base models ship instead: no chat template, and a tokenizer whose
post-processor puts `<s>` in front of every text it encodes with special tokens (as Llama's does),
so `tokenizer(text)` and `tokenizer(text, add_special_tokens=False)` differ by that one token.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "<|im_end|>"
IM_START = "<|im_start|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS, IM_START, TOOL_CALL_OPEN, TOOL_CALL_CLOSE]
CHARACTERS = string.printable  # digits, letters, punctuation, space, \t \n \r \x0b \x0c

CHAT_TEMPLATE = (
    "{% if messages and messages[0].role == 'system' %}"
    "{% set system = messages[0].content %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = none %}{% set rest = messages %}{% endif %}"
    "{% if system is not none or tools %}"
    "<|im_start|>system\n{{ system if system is not none else '' }}"
    "{% if tools %}\n\n# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    '</tools>\nCall a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    "{% endif %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in rest %}"
    "<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.role == 'assistant' and m.tool_calls %}"
    "{% for call in m.tool_calls %}{% set f = call.function if call.function else call %}"
    '<tool_call>{"name": {{ f.name | tojson }}, "arguments": '
    "{{ f.arguments if f.arguments is string else (f.arguments | tojson) }}}</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """Shape of a tiny model. The defaults train quickly on two cores (about 0.5 M parameters)."""

    arch: Literal["llama", "qwen2"] = "llama"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 2048
    seed: int = 0


def char_tokenizer(*, base: bool = False) -> object:
    """A `PreTrainedTokenizerFast` with one token per printable character plus the chat markers;
    `base`: no chat template, and `<s>` added in front of every text (see the module doc)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    if base:
        core.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=[IM_START, TOOL_CALL_OPEN, TOOL_CALL_CLOSE],
        clean_up_tokenization_spaces=False,
    )
    if not base:
        tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 1 << 20
    return tok


def build_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec | None = None, *, base: bool = False
) -> Path:
    """Write a randomly initialised tiny causal LM and its tokenizer to `out_dir`; return it.
    `base`: the tokenizer of a base model (`char_tokenizer(base=True)`)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    spec = spec or TinyModelSpec()
    tok = char_tokenizer(base=base)
    common = dict(
        vocab_size=len(tok),  # type: ignore[arg-type]
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,  # type: ignore[attr-defined]
        bos_token_id=tok.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
    )
    config = LlamaConfig(**common) if spec.arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id  # type: ignore[attr-defined]
    model.generation_config.eos_token_id = tok.eos_token_id  # type: ignore[attr-defined]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)  # type: ignore[attr-defined]
    return out
