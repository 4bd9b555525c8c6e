"""The OpenAI request bodies the endpoint takes, checked, and the prompt ids each one becomes.

Sampling follows the run, not the request: `temperature`, `top_p`, `top_k`, `seed` and the like are
accepted and ignored, because the trainer recomputes the behaviour log-probs with the rollout's
settings (`rollout.temperature`), and a call sampled otherwise would train on log-probs of another
distribution. What a request may set: `max_tokens` / `max_completion_tokens` (capped by the
run's per-turn and per-episode budgets) and `stop` strings. `n` above 1, `stream`, `logit_bias`,
`response_format`, `functions` are refused by name.

Prompt ids, token for token what the model saw and sampled:

- chat: when the messages are the previous call's messages, then the assistant message it
  returned (same content and tool calls), then new messages of other roles (tool results, a
  user's reply), and the tools are the same, the prompt is the previous call's prompt and sampled
  ids, the end of turn the model did not sample, and the new messages rendered as the episode
  runner renders them (`ChatRenderer.new_message_ids`). Anything else is rendered whole with the
  chat template (a new segment, unless it happens to extend the ids anyway).
- completions: a prompt of token ids is used as given; a text prompt that begins with the previous
  call's prompt text and the text it returned continues the previous ids with the rest encoded;
  any other text is tokenized whole.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from dora.render import ChatRenderer
from dora.tool_calls import ParsedTurn, ToolCall, parse_tool_calls
from dora.tools import JSON

__all__ = [
    "BadRequest",
    "ChatState",
    "TextState",
    "assistant_turn",
    "chat_prompt",
    "messages_of",
    "reply_text",
    "sampling",
    "text_prompt",
]

REFUSED = ("logit_bias", "response_format", "functions", "function_call", "suffix", "echo")


class BadRequest(ValueError):
    """A request the endpoint answers with an error; `reason` is its short counted key."""

    def __init__(self, message: str, reason: str, status: int = 400) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


def sampling(body: Mapping[str, object]) -> tuple[int | None, list[str]]:
    """(max_tokens asked, stop strings) of a request; BadRequest for what cannot be honoured."""
    if body.get("stream"):
        raise BadRequest("streaming is not supported by this endpoint: set stream=False", "stream")
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadRequest(f"n = {n!r}: this endpoint samples one choice per call", "n")
    refused = sorted(k for k in REFUSED if body.get(k) not in (None, False))
    if refused:
        raise BadRequest(f"unsupported field(s): {', '.join(refused)}", "unsupported field")
    cap = body.get("max_completion_tokens") or body.get("max_tokens")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise BadRequest(f"max_tokens = {cap!r}: expected a positive integer", "bad field")
    stop = body.get("stop") or []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"stop = {stop!r}: expected a string or a list of strings", "bad field")
    return cap, [s for s in stops if s]


def _text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise BadRequest(f"{where}: only text content parts are supported", "bad message")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadRequest(f"{where}: content must be text", "bad message")


def _tool_calls(raw: object, where: str) -> list[ToolCall]:
    if not isinstance(raw, list):
        raise BadRequest(f"{where}.tool_calls must be a list", "bad message")
    calls: list[ToolCall] = []
    for call in raw:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}: a tool call without a function name", "bad message")
        args = fn.get("arguments", "{}")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return calls


def messages_of(raw: object) -> list[JSON]:
    """The request's messages in the shape the chat template and the runner use."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list", "bad message")
    out: list[JSON] = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"{where}: a message needs a role of {ROLES}", "bad message")
        clean: JSON = {"role": message["role"], "content": _text(message.get("content"), where)}
        if message.get("tool_calls"):
            clean["tool_calls"] = _tool_calls(message["tool_calls"], where)
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                clean[key] = message[key]
        out.append(clean)
    return out


ROLES = ("system", "developer", "user", "assistant", "tool")


def _same_turn(sent: JSON, returned: JSON) -> bool:
    """The agent's copy of an assistant message the endpoint returned: same text, same calls
    (names and decoded arguments; ids and key order aside)."""

    def calls(m: JSON) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for c in cast("list[ToolCall]", m.get("tool_calls") or []):
            try:
                args = json.loads(c["function"]["arguments"])
            except json.JSONDecodeError:
                args = c["function"]["arguments"]
            out.append((c["function"]["name"], args))
        return out

    return (
        sent["role"] == "assistant"
        and sent["content"] == returned["content"]
        and calls(sent) == calls(returned)
    )


@dataclass
class ChatState:
    """The previous chat call of an episode, to continue its ids."""

    messages: list[JSON]
    tools: list[JSON]
    returned: JSON
    ids: list[int]
    """The previous call's prompt and sampled ids."""
    turn_end: str
    """What of the template's end of turn the model did not sample."""


def chat_prompt(
    renderer: ChatRenderer, state: ChatState | None, messages: list[JSON], tools: list[JSON]
) -> list[int]:
    """The prompt ids of a chat call (see the module docstring)."""
    if state is not None and tools == state.tools:
        n = len(state.messages)
        new = messages[n + 1 :]
        if (
            new
            and messages[:n] == state.messages
            and _same_turn(messages[n], state.returned)
            and all(m["role"] != "assistant" for m in new)
        ):
            rest = renderer.encode(state.turn_end)
            return state.ids + rest + renderer.new_message_ids(new)  # type: ignore[arg-type]
    return renderer.prompt_ids(messages, tools)  # type: ignore[arg-type]


@dataclass
class TextState:
    """The previous completions call of an episode: its prompt text with the text returned, and
    the ids (prompt and sampled) they stand for."""

    text: str
    ids: list[int]


def text_prompt(renderer: ChatRenderer, state: TextState | None, prompt: object) -> list[int]:
    """The prompt ids of a completions call (see the module docstring)."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string or a list of token ids", "bad prompt")
    if state is not None and prompt.startswith(state.text):
        return state.ids + renderer.encode(prompt[len(state.text) :])
    return renderer.prompt_ids(prompt, ())


def _cut(text: str, stops: list[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def reply_text(renderer: ChatRenderer, token_ids: Sequence[int], stops: list[str]) -> str:
    """The text of sampled ids as a completions client sees it: without a final end-of-sequence
    token and cut before the first stop string."""
    ids = list(token_ids)
    eos = getattr(renderer.tokenizer, "eos_token_id", None)
    if ids and eos is not None and ids[-1] == eos:
        ids = ids[:-1]
    return _cut(renderer.decode(ids), stops)


def assistant_turn(
    renderer: ChatRenderer, token_ids: Sequence[int], stops: list[str], tools: bool
) -> tuple[str, ParsedTurn]:
    """(the end of turn the model did not sample, the turn as a chat client sees it). The turn's
    sampled end (`<|im_end|>`) and a final end-of-sequence text are not content; tool calls are
    read by the runner's parser when the request offered tools. A malformed call leaves the
    whole text as the content (the client sees what the model wrote) and is counted."""
    content, turn_end = renderer.split_turn_end(renderer.decode(token_ids))
    eos = getattr(renderer.tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos and content.endswith(eos):
        content = content[: -len(eos)]
    content = _cut(content, stops)
    if not tools:
        return turn_end, ParsedTurn(content=content)
    parsed = parse_tool_calls(content)
    if parsed.errors:
        return turn_end, ParsedTurn(content=content, calls=parsed.calls, errors=parsed.errors)
    return turn_end, parsed
