"""A small client for an OpenAI-compatible `/v1/chat/completions` endpoint (aiohttp), used for the
user simulator and the natural-language-assertion judge.

These endpoints serve frozen models outside dora's instance pool (docs/scheduling.md): an
episode waiting for the simulated user must never hold an instance slot that the user needs. Their
tokens never enter the training data: only the reply text goes back into the conversation, where
the runner renders it as environment tokens (loss mask 0).

Every request has a deadline and a bounded number of retries with backoff on connection errors and
5xx answers; a 4xx answer, a malformed body or running out of retries raises `EnvError`, which masks
the episode (a dead user simulator must not teach the policy anything). No `openai` package:
aiohttp is already a dora dependency. A caller may pass its own session (`Tau2Env` keeps one per
episode, with its connections kept alive, and closes it in the environment's `close()`); without
one, each request gets a session of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from dora import EnvError

JSON = dict[str, object]
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class ChatEndpoint:
    """Where a frozen chat model is served and how to sample from it."""

    url: str
    """Base URL of an OpenAI-compatible server, e.g. `http://127.0.0.1:8001/v1`."""
    model: str = ""
    """Model name sent in each request ('' lets the server pick its only model)."""
    api_key: str = ""
    """Bearer token, if the server wants one."""
    temperature: float = 0.0
    max_tokens: int = 1024
    timeout_s: float = 120.0
    """Deadline of one request."""
    retries: int = 2
    """Extra attempts after a connection error or a 5xx answer."""

    async def complete(
        self,
        messages: Sequence[JSON],
        *,
        tools: Sequence[JSON] = (),
        session: aiohttp.ClientSession | None = None,
    ) -> JSON:
        """The assistant message the endpoint answers to `messages` (OpenAI format); reasoning
        (`<think>...</think>`) is stripped from its content."""
        body: JSON = {
            "messages": list(messages),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.model:
            body["model"] = self.model
        if tools:
            body["tools"] = list(tools)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        url = self.url.rstrip("/") + "/chat/completions"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(0.5 * 2**attempt, 8.0))
            try:
                async with asyncio.timeout(self.timeout_s), contextlib.AsyncExitStack() as stack:
                    client = session
                    if client is None:
                        client = await stack.enter_async_context(aiohttp.ClientSession())
                    response = await stack.enter_async_context(
                        client.post(url, json=body, headers=headers)
                    )
                    if response.status >= 500:
                        last = f"HTTP {response.status}: {(await response.text())[:200]}"
                        continue
                    if response.status != 200:
                        text = (await response.text())[:500]
                        raise EnvError(f"{url} answered HTTP {response.status}: {text}")
                    payload = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            return _message(payload, url)
        raise EnvError(f"{url} failed {self.retries + 1} time(s); last: {last}")


def _message(payload: object, url: str) -> JSON:
    try:
        message = payload["choices"][0]["message"]  # type: ignore[index]
    except (KeyError, IndexError, TypeError) as exc:
        raise EnvError(f"{url} answered without choices[0].message: {str(payload)[:300]}") from exc
    if not isinstance(message, dict):
        raise EnvError(f"{url} answered a message that is not an object: {message!r}")
    content = message.get("content")
    message["content"] = _THINK.sub("", content).strip() if isinstance(content, str) else ""
    return message
