"""Text in, OpenAI JSON out: chat prompts, completion and chat responses, SSE chunks.

Output text excludes a final stop token (EOS or a `stop_token_ids` hit) and is cut before the first
stop string, as in vLLM; `token_ids` always hold every sampled token, because training needs exactly
what was sampled. Completion text skips special tokens unless asked not to; chat text keeps them, so
that `<tool_call>` markers (special tokens in some tokenizers) reach the hermes parser. A streamed
choice holds back as many characters as the longest stop string minus one, so no stop string is ever
sent.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dora.engine.sequence import Sequence
from dora.instance import api
from dora.tool_calls import parse_tool_calls

TensorSource = Callable[[], dict[str, torch.Tensor]]
Json = dict[str, object]


@dataclass(frozen=True)
class Meta:
    id: str
    model: str
    created: int
    prompt_tokens: int


class Renderer:
    def __init__(self, tokenizer: object, eos_token_ids: list[int]) -> None:
        self.tok = tokenizer
        self.eos = set(eos_token_ids)

    def chat_prompt(
        self,
        messages: list[dict[str, object]],
        tools: list[dict[str, object]] | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        try:
            text = self.tok.apply_chat_template(  # type: ignore[attr-defined]
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # jinja errors of every kind: the caller's messages are malformed
            raise ValueError(f"chat template failed on these messages: {exc}") from exc
        return list(self.tok(text, add_special_tokens=False).input_ids)  # type: ignore[operator]

    def text(self, seq: Sequence, count: int, *, skip_special: bool, final: bool) -> str:
        ids = seq.token_ids[:count]
        if (
            final
            and seq.finish_reason == "stop"
            and ids
            and (ids[-1] in self.eos or ids[-1] in seq.params.stop_token_ids)
        ):
            ids = ids[:-1]
        text: str = self.tok.decode(ids, skip_special_tokens=skip_special)  # type: ignore[attr-defined]
        cut = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut]
        if not final and seq.params.stop:
            hold = max(len(s) for s in seq.params.stop) - 1
            return text[: len(text) - hold] if hold else text
        return text

    def completion_response(
        self, meta: Meta, req: api.CompletionRequest, seqs: list[Sequence]
    ) -> Json:
        # The sampled tokens, their log-probs and versions as typed arrays: `wire.answer` sends
        # them as raw bytes in msgpack (dora's client) and as lists in JSON.
        choices = []
        for i, seq in enumerate(seqs):
            logprobs = self._legacy_logprobs(seq, 0) if req.logprobs is not None else None
            if logprobs is not None:
                logprobs["token_logprobs"] = array("f", seq.logprobs)
            choice: Json = {
                "index": i,
                "text": self.text(
                    seq, len(seq.token_ids), skip_special=req.skip_special_tokens, final=True
                ),
                "finish_reason": seq.finish_reason,
                "logprobs": logprobs,
            }
            if req.return_token_ids:
                choice.update(
                    token_ids=array("i", seq.token_ids), versions=array("i", seq.versions)
                )
                if req.session_id is None:  # a session's caller holds its context already
                    choice["prompt_token_ids"] = seq.prompt_ids
            choices.append(choice)
        return self._envelope(meta, "text_completion", choices, seqs)

    def chat_response(self, meta: Meta, req: api.ChatRequest, seqs: list[Sequence]) -> Json:
        choices = []
        for i, seq in enumerate(seqs):
            message, finish = self._message(seq, bool(req.tools))
            choice: Json = {"index": i, "message": message, "finish_reason": finish}
            choice["logprobs"] = self._chat_logprobs(seq, 0) if req.logprobs else None
            if req.return_token_ids:
                choice.update(
                    token_ids=seq.token_ids, prompt_token_ids=seq.prompt_ids, versions=seq.versions
                )
            choices.append(choice)
        return self._envelope(meta, "chat.completion", choices, seqs)

    def _message(self, seq: Sequence, tools: bool) -> tuple[Json, str | None]:
        text = self.text(seq, len(seq.token_ids), skip_special=False, final=True)
        content: str | None = text
        calls: list[Json] = []
        if tools:
            # One parser with the episode runner (dora/tool_calls.py). A turn with a malformed call
            # is returned whole as content: an OpenAI message has no place for the error.
            turn = parse_tool_calls(text)
            calls = [dict(c) for c in turn.calls]
            content = text if turn.errors else (turn.content or None)
        message: Json = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if calls and seq.finish_reason == "stop" else seq.finish_reason
        return message, finish

    def _envelope(self, meta: Meta, kind: str, choices: list[Json], seqs: list[Sequence]) -> Json:
        generated = sum(len(s.token_ids) for s in seqs)
        version = next(
            (s.versions[0] for s in seqs if s.versions), seqs[0].version if seqs else None
        )
        return {
            "id": meta.id,
            "object": kind,
            "created": meta.created,
            "model": meta.model,
            "version": version if version is not None else -1,
            "choices": choices,
            "usage": {
                "prompt_tokens": meta.prompt_tokens,
                "completion_tokens": generated,
                "total_tokens": meta.prompt_tokens + generated,
            },
        }

    def _legacy_logprobs(self, seq: Sequence, start: int, end: int | None = None) -> Json:
        ids = seq.token_ids[start:end]
        return {
            "tokens": self.tok.convert_ids_to_tokens(ids),  # type: ignore[attr-defined]
            "token_logprobs": seq.logprobs[start : start + len(ids)],
            "top_logprobs": None,
            "text_offset": None,
        }

    def _chat_logprobs(self, seq: Sequence, start: int, end: int | None = None) -> Json:
        ids = seq.token_ids[start:end]
        tokens = self.tok.convert_ids_to_tokens(ids)  # type: ignore[attr-defined]
        lps = seq.logprobs[start : start + len(ids)]
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(tokens, lps, strict=True)
            ]
        }


class Streamer:
    """Turns sequence progress into SSE chunks (`data: {...}`), one choice at a time."""

    def __init__(
        self,
        renderer: Renderer,
        meta: Meta,
        req: api.CompletionRequest | api.ChatRequest,
        seqs: list[Sequence],
    ) -> None:
        self.r, self.meta, self.req, self.seqs = renderer, meta, req, seqs
        self.chat = isinstance(req, api.ChatRequest)
        self.hold_all = self.chat and bool(getattr(req, "tools", None))
        self.sent_tokens = [0] * len(
            seqs
        )  # tokens, and characters of text, already sent per choice
        self.sent_chars = [0] * len(seqs)
        self.closed = [False] * len(seqs)

    def chunks(self, i: int, count: int, done: bool) -> list[Json]:
        if self.closed[i] or (count <= self.sent_tokens[i] and not done):
            return []
        seq = self.seqs[i]
        if seq.error:
            self.closed[i] = True
            return [{"error": {"message": seq.error, "code": seq.error_status}}]
        start = self.sent_tokens[i]
        choice: Json = {"index": i, "finish_reason": None}
        if self.hold_all and not done:
            return []
        if self.hold_all:
            message, finish = self.r._message(seq, True)
            delta: Json = {"role": "assistant", "content": message["content"]}
            if "tool_calls" in message:
                calls: list[Json] = message["tool_calls"]  # type: ignore[assignment]
                delta["tool_calls"] = [{**c, "index": k} for k, c in enumerate(calls)]
            choice["delta"] = delta
            choice["finish_reason"] = finish
        else:
            skip = not self.chat and getattr(self.req, "skip_special_tokens", True)
            text = self.r.text(seq, count, skip_special=skip, final=done)
            piece = text[self.sent_chars[i] :]
            self.sent_chars[i] = len(text)
            if self.chat:
                choice["delta"] = (
                    {"content": piece} if start else {"role": "assistant", "content": piece}
                )
            else:
                choice["text"] = piece
            if done:
                choice["finish_reason"] = seq.finish_reason
        if self.req.logprobs:
            lps = self.r._chat_logprobs if self.chat else self.r._legacy_logprobs
            choice["logprobs"] = lps(seq, start, count)
        if self.req.return_token_ids:
            choice["token_ids"] = seq.token_ids[start:count]
            choice["versions"] = seq.versions[start:count]
        self.sent_tokens[i] = count
        self.closed[i] = done
        version = seq.versions[count - 1] if count else seq.version
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        head = {
            "id": self.meta.id,
            "object": kind,
            "created": self.meta.created,
            "model": self.meta.model,
        }
        return [{**head, "version": version, "choices": [choice]}]

    def final(self) -> list[Json]:
        options = self.req.stream_options
        if options is None or not options.include_usage:
            return []
        generated = sum(len(s.token_ids) for s in self.seqs)
        usage = {
            "prompt_tokens": self.meta.prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": self.meta.prompt_tokens + generated,
        }
        return [
            {
                "id": self.meta.id,
                "object": "text_completion",
                "created": self.meta.created,
                "model": self.meta.model,
                "choices": [],
                "usage": usage,
            }
        ]
