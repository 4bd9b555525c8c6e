"""One episode's side of the endpoint: its calls, each sampled by the episode's pinned sampler.

Every call of a session goes to the one `Sampler` the runner gave the episode (serve's lease
sampler, pinned to the episode's version: C1), one call at a time in the order they arrive, and
is recorded token for token (`CallRecord`). The episode's limits hold as in the runner: at most
`max_turns` calls, `max_total_tokens` sampled tokens over all calls, `context_limit` tokens in a
prompt with its completion; a call past one is refused (400) and the sample's finish reason says
which ("max_turns", "length", "context").

A sampler that raises (a dead server) fails the call (503) and the episode: the runner raises the
error once the agent has returned, as the episode runner lets it propagate. An instance that ends
the request ("abort", "error") masks the sample with the runner's reason.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from dora.endpoint.record import CallRecord
from dora.endpoint.requests import (
    BadRequest,
    ChatState,
    TextState,
    assistant_turn,
    chat_prompt,
    messages_of,
    reply_text,
    sampling,
    text_prompt,
)
from dora.episode_guard import SAMPLER_ENDED
from dora.protocol import Completion, FinishReason, SamplingParams
from dora.render import ChatRenderer
from dora.tools import JSON

if TYPE_CHECKING:
    from dora.episode import EpisodeLimits, Sampler

__all__ = ["Session"]


class Session:
    """The endpoint of one episode (see the module docstring)."""

    def __init__(
        self,
        *,
        sampler: Sampler,
        renderer: ChatRenderer,
        params: SamplingParams,
        limits: EpisodeLimits,
        model: str,
    ) -> None:
        self.sampler = sampler
        self.renderer = renderer
        self.params = params
        self.limits = limits
        self.model = model
        self.record = CallRecord()
        self.finish: FinishReason = "stop"
        self.failure: str | None = None
        """Why an instance ended a call: the sample is masked with it."""
        self.error: BaseException | None = None
        """What the sampler raised: the runner raises it."""
        self._chat: ChatState | None = None
        self._text: TextState | None = None
        self._lock = asyncio.Lock()

    def _check_model(self, body: Mapping[str, object]) -> None:
        model = body.get("model")
        if model != self.model:
            raise BadRequest(
                f"the model {model!r} does not exist: this endpoint serves {self.model!r}",
                "wrong model",
                404,
            )

    async def chat(self, body: Mapping[str, object]) -> JSON:
        """`POST /chat/completions`."""
        self._check_model(body)
        cap, stops = sampling(body)
        messages = messages_of(body.get("messages"))
        tools = body.get("tools") or []
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise BadRequest("tools must be a list of tool objects", "bad field")
        use_tools = bool(tools) and body.get("tool_choice") != "none"
        async with self._lock:
            try:
                prompt = chat_prompt(self.renderer, self._chat, messages, tools)
            except Exception as exc:  # the chat template on the agent's messages
                raise BadRequest(f"cannot render these messages: {exc}", "bad message") from exc
            completion = await self._generate(prompt, cap, stops)
            turn_end, parsed = assistant_turn(self.renderer, completion.token_ids, stops, use_tools)
            message: JSON = {"role": "assistant", "content": parsed.content}
            if parsed.calls:
                message["tool_calls"] = parsed.calls
            self.record.tool_calls += len(parsed.calls) + len(parsed.errors)
            self.record.tool_errors += len(parsed.errors)
            ids = prompt + list(completion.token_ids)
            self._chat = ChatState(messages, tools, message, ids, turn_end)
        finish = "tool_calls" if parsed.calls else _finish(completion)
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        return self._answer("chat.completion", choice, prompt, completion)

    async def complete(self, body: Mapping[str, object]) -> JSON:
        """`POST /completions`."""
        self._check_model(body)
        cap, stops = sampling(body)
        async with self._lock:
            prompt = text_prompt(self.renderer, self._text, body.get("prompt"))
            completion = await self._generate(prompt, cap or 16, stops)
            text = reply_text(self.renderer, completion.token_ids, stops)
            raw = body.get("prompt")
            if isinstance(raw, list) and len(raw) == 1:
                raw = raw[0]
            ids = prompt + list(completion.token_ids)
            self._text = TextState(raw + text, ids) if isinstance(raw, str) else None
        choice = {"index": 0, "text": text, "finish_reason": _finish(completion), "logprobs": None}
        return self._answer("text_completion", choice, prompt, completion)

    def _answer(self, kind: str, choice: JSON, prompt: list[int], completion: Completion) -> JSON:
        n = len(completion.token_ids)
        # the exact ids, as vLLM's `return_token_ids` names them: a client may check them
        choice["token_ids"] = list(completion.token_ids)
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": n,
                "total_tokens": len(prompt) + n,
            },
            "prompt_token_ids": prompt,
        }

    async def _generate(self, prompt: list[int], cap: int | None, stops: list[str]) -> Completion:
        """One sampled completion of `prompt` within the episode's limits, recorded."""
        limits, record = self.limits, self.record
        if self.error is not None or self.failure is not None:
            raise BadRequest("the episode's sampler failed; no more calls", "sampler", 503)
        if len(record.calls) >= limits.max_turns:
            self.finish = "max_turns"
            raise BadRequest(
                f"this episode's limit of {limits.max_turns} model calls is reached", "max turns"
            )
        token_budget = limits.max_total_tokens - record.sampled
        context_budget = limits.context_limit - len(prompt)
        asked = min(cap or self.params.max_tokens, self.params.max_tokens)
        budget = min(asked, token_budget, context_budget)
        if context_budget <= 0 or token_budget <= 0:
            self.finish = "context" if context_budget <= 0 else "length"
            what = f"{len(prompt)} prompt tokens fill" if context_budget <= 0 else "tokens spent"
            raise BadRequest(
                f"{what} this episode's budget (context {limits.context_limit}, "
                f"{limits.max_total_tokens} sampled tokens)",
                self.finish,
            )
        params = msgspec.structs.replace(
            self.params, max_tokens=budget, stop=[*self.params.stop, *stops]
        )
        try:
            completion = await self.sampler.generate(prompt, params)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.error = exc
            raise BadRequest(f"the sampler failed: {exc}", "sampler", 503) from exc
        if completion.finish_reason in ("abort", "error"):
            self.failure = f"{SAMPLER_ENDED} with {completion.finish_reason!r}"
            raise BadRequest(self.failure, "sampler", 503)
        record.add(prompt, completion)
        if completion.finish_reason == "length" and budget < asked:  # cut by the episode's limit
            self.finish = "context" if context_budget <= token_budget else "length"
        return completion


def _finish(completion: Completion) -> str:
    return "length" if completion.finish_reason == "length" else "stop"
