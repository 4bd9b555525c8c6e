"""Models dora can build offline: tiny causal LMs with a character tokenizer, for tests and
examples."""

from dora.models.tiny import TinyModelSpec, build_tiny_model, char_tokenizer

__all__ = ["TinyModelSpec", "build_tiny_model", "char_tokenizer"]
