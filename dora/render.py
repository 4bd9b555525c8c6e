"""How prompts and turns become token ids: the chat template, probed once, and a cached encoder.

Invariants (docs/environments.md, "How an episode becomes a training sample"):

- A plain-text prompt becomes `tokenizer(prompt)`'s ids (special tokens included unless turned
  off), with no chat template: a base model without one serves plain-text environments. Text
  appended to it later (the model's turns, the environment's replies) is encoded without special
  tokens.
- Only new environment messages (tool results, user replies) are rendered, like this: render a fixed
  probe conversation `[user, assistant]`, render the probe followed by the new messages with the
  generation prompt, and append the tokens of the difference. We render the new messages behind a
  probe rather than behind the real history because the real history contains assistant turns whose
  re-rendering need not equal what was sampled; the probe's last turn being an assistant makes
  templates that depend on the previous role (tool results grouped after an assistant) render right.
- The template's text between the end of an assistant message and the next message (ChatML: the
  `\\n` after `<|im_end|>`) is `turn_end`; the runner appends what of it the model did not sample.
- Decoding is the tokenizer's, without its per-call overhead where the result is provably the same
  (a fast tokenizer that does not clean up spaces; a fused word-level vocabulary is a join).
  Encoding likewise: with a one-token-per-character vocabulary (the tiny character models) text
  without an added token maps character by character, what the tokenizer's regex split and
  word-level lookup give at about 15 times the cost.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from dora.errors import ChatTemplateMissing, EnvError
from dora.tools import JSON

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dora.env import Message

__all__ = ["ChatRenderer"]

_ENCODE_CACHE_SIZE = 1024
_ENCODE_CACHE_CHARS = 1 << 16
_PROMPT_CACHE_SIZE = 256


def _fused_pieces(backend: Any) -> list[str] | None:
    """The token strings of a word-level tokenizer whose decoder only concatenates them (the
    tiny character models): decoding is then a join, four times cheaper than the tokenizer's own
    call. None for any other tokenizer."""
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, TypeError, ValueError):
        return None
    decoder = spec.get("decoder") or {}
    if spec.get("model", {}).get("type") != "WordLevel" or decoder.get("type") != "Fuse":
        return None
    vocab = dict(backend.get_vocab(with_added_tokens=True))
    pieces = [""] * (max(vocab.values(), default=-1) + 1)
    for piece, i in vocab.items():
        pieces[i] = piece
    return pieces


def _character_vocab(backend: Any) -> tuple[dict[str, int], int, tuple[str, ...]] | None:
    """(character -> id, the unknown token's id, the added tokens' texts) of a word-level
    tokenizer that splits text into single characters with no normalizer: encoding text that
    holds no added token is then one lookup per character. None for any other tokenizer."""
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, TypeError, ValueError):
        return None
    model, split = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    one_char = (
        split.get("type") == "Split"
        and split.get("pattern") == {"Regex": r"[\s\S]"}
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
    )
    if model.get("type") != "WordLevel" or spec.get("normalizer") is not None or not one_char:
        return None
    vocab = dict(backend.get_vocab(with_added_tokens=False))
    unk = vocab.get(model.get("unk_token"))
    if unk is None:
        return None
    added = tuple(str(t["content"]) for t in spec.get("added_tokens") or ())
    return {p: i for p, i in vocab.items() if len(p) == 1}, unk, added


class ChatRenderer:
    """Renders prompts to token ids with a Hugging Face tokenizer (see the module doc).

    A plain-text prompt becomes `tokenizer(prompt)`'s ids: what `model.generate` and other
    trainers see, special tokens (a base model's `<bos>`) included; `add_special_tokens=False`
    leaves them out. Everything appended later (sampled turns, replies) is encoded without them.
    The chat template is probed only when a chat prompt needs it, so a base model without one
    serves plain-text environments; a chat prompt on such a tokenizer raises `ChatTemplateMissing`
    (a `ConfigError`) that names the model folder.
    """

    _PROBE_TEXT = "\x1fdora-probe\x1f"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, add_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self._encoded: OrderedDict[str, list[int]] = OrderedDict()
        self._prompts: OrderedDict[str, list[int]] = OrderedDict()  # a group's G share one
        # Rust decoding gives transformers' text only when transformers would not clean it up.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans = bool(getattr(tokenizer, "clean_up_tokenization_spaces", True))
        self._fast = backend if backend is not None and not cleans else None
        self._pieces = _fused_pieces(self._fast) if self._fast is not None else None
        self._chars = _character_vocab(backend) if backend is not None else None
        self._probe: list[Message] = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": self._PROBE_TEXT},
        ]

    @functools.cached_property
    def _probe_text(self) -> str:
        return self.render(self._probe, add_generation_prompt=False)

    @functools.cached_property
    def turn_end(self) -> str:
        """Template text after an assistant message's content (ChatML: `<|im_end|>\\n`)."""
        end = self._probe_text.rindex(self._PROBE_TEXT) + len(self._PROBE_TEXT)
        return self._probe_text[end:]

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[JSON] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            folder = getattr(self.tokenizer, "name_or_path", "") or "the model folder"
            raise ChatTemplateMissing(
                f"the tokenizer of {folder} has no chat template (tokenizer_config.json has no "
                "'chat_template', and there is no chat_template.jinja), but the environment's "
                "reset() returned chat messages: return a plain-text prompt (a str; "
                "SingleTurnEnv: chat = False) for a base model, or use a model with a chat template"
            )
        schemas: list[dict[Any, Any] | Callable[..., Any]] = list(tools or ())
        text = self.tokenizer.apply_chat_template(
            cast("list[dict[str, str]]", list(messages)),
            tools=schemas or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text

    def encode(self, text: str) -> list[int]:
        """Text that continues a sequence: no special tokens. The G episodes of a group encode
        the same prompt: recent texts are remembered."""
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encode_uncached(text)
            if len(text) <= _ENCODE_CACHE_CHARS:
                self._encoded[text] = ids
                while len(self._encoded) > _ENCODE_CACHE_SIZE:
                    self._encoded.popitem(last=False)
        return list(ids)

    def _encode_uncached(self, text: str) -> list[int]:
        if self._chars is not None:
            chars, unk, added = self._chars
            if not any(token in text for token in added):
                return [chars.get(c, unk) for c in text]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._pieces is not None:  # a fused word-level vocabulary: the text is the pieces
            pieces = self._pieces
            with contextlib.suppress(IndexError):  # an id past the vocabulary: the slow path
                return "".join([pieces[t] for t in token_ids])
        if self._fast is not None:  # the same text, without transformers' per-call overhead
            return str(self._fast.decode(list(token_ids), skip_special_tokens=False))
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def prompt_ids(self, prompt: Sequence[Message] | str, tools: Sequence[JSON]) -> list[int]:
        """The opening prompt: plain text as `tokenizer(prompt)` gives it (special tokens unless
        `add_special_tokens` is off), messages with the chat template and the generation prompt."""
        if isinstance(prompt, str):
            ids = self._prompts.get(prompt)
            if ids is None:
                encoded = self.tokenizer(prompt, add_special_tokens=self.add_special_tokens)
                ids = list(encoded["input_ids"])
                if len(prompt) <= _ENCODE_CACHE_CHARS:
                    self._prompts[prompt] = ids
                while len(self._prompts) > _PROMPT_CACHE_SIZE:
                    self._prompts.popitem(last=False)
            return list(ids)
        return self.encode(self.render(prompt, tools=tools))

    def split_turn_end(self, sampled_text: str) -> tuple[str, str]:
        """(the turn's text without its sampled end-of-turn, the end-of-turn text still to
        append)."""
        for k in range(len(self.turn_end), 0, -1):
            if sampled_text.endswith(self.turn_end[:k]):
                return sampled_text[:-k], self.turn_end[k:]
        return sampled_text, self.turn_end

    def new_message_ids(self, messages: Sequence[Message]) -> list[int]:
        """New environment messages rendered after an assistant turn, with the generation prompt."""
        full = self.render([*self._probe, *messages])
        if not full.startswith(self._probe_text):
            raise EnvError(
                "the chat template renders the conversation differently once messages are added "
                "after it, so turns cannot be appended as tokens; use a prefix-stable template"
            )
        return self.encode(full[len(self._probe_text) :])
