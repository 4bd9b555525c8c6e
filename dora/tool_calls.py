"""Tool calls in sampled text: the one parser that the engine's chat endpoint and the episode
runner share, so that both read the same text as the same calls.

Calls are parsed from the text the model sampled, never from a re-rendering of it, in two formats:

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (any number per turn; a final
  call whose closing tag is missing because sampling stopped right after it is accepted when its
  JSON parses). The turn's content is the text before the first `<tool_call>`; text between and
  after blocks is not content (vLLM's hermes parser does the same).
- OpenAI JSON: the whole turn is a JSON object `{"name": ..., "arguments": ...}`, a list of them,
  or `{"tool_calls": [{"type": "function", "function": {...}}]}`. Its content is empty.

`arguments` may be a JSON object or a string holding one (`parameters` is read as `arguments`);
every call's `arguments` comes out as the `json.dumps` text of an object.

A block that is not a call (bad JSON, no string `name`, arguments that are not an object) is an
entry of `ParsedTurn.errors`, never an exception and never dropped silently. What each consumer
does with it is its policy: the runner answers it with a tool error message the model reads (as
it answers a call that fails); the chat endpoint, which cannot send an error inside an OpenAI
message, returns the well-formed calls and keeps the whole sampled text as the message content,
so a client sees exactly what the model wrote (docs/engine.md).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal, TypedDict

__all__ = ["FunctionCall", "ParsedTurn", "ToolCall", "parse_tool_calls"]


class FunctionCall(TypedDict):
    """The function part of an OpenAI tool call; `arguments` is a JSON object encoded as a
    string."""

    name: str
    arguments: str


class ToolCall(TypedDict):
    """One OpenAI-style tool call."""

    id: str
    type: Literal["function"]
    function: FunctionCall


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its text and its tool calls.

    `content` is the turn's text outside tool calls; `errors[i]` describes a malformed call (the
    runner answers it with a tool message, like a call).
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def _make_call(obj: object) -> ToolCall | str:
    """A ToolCall from a decoded JSON object, or the reason it is not one."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
        assert isinstance(obj, dict)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return 'missing "name"'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f'"arguments" of {name!r} is not valid JSON: {exc}'
    if not isinstance(args, dict):
        return f'"arguments" of {name!r} must be a JSON object'
    return {
        "id": f"call_{uuid.uuid4().hex[:12]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _openai_json(text: str) -> list[object] | None:
    """The call objects if the whole text is OpenAI-style tool-call JSON, else None."""
    stripped = text.strip()
    if not stripped or stripped[0] not in "[{":
        return None
    try:
        obj = json.loads(stripped)
    except json.JSONDecodeError:
        return None
    items = obj.get("tool_calls") if isinstance(obj, dict) and "tool_calls" in obj else obj
    items = items if isinstance(items, list) else [items]

    def looks_like_call(x: object) -> bool:
        return isinstance(x, dict) and ("function" in x or ("name" in x and "arguments" in x))

    return items if items and all(looks_like_call(x) for x in items) else None


def parse_tool_calls(text: str) -> ParsedTurn:
    """Split sampled assistant text into content and tool calls (hermes tags, else OpenAI JSON)."""
    if "<tool_call>" in text:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for match in _HERMES.finditer(text):
            body = match.group(1).strip()
            try:
                result = _make_call(json.loads(body))
            except json.JSONDecodeError as exc:
                result = f"tool call is not valid JSON ({exc}): {body[:200]!r}"
            if isinstance(result, str):
                errors.append(result)
            else:
                calls.append(result)
        content = text[: text.index("<tool_call>")].rstrip()
        return ParsedTurn(content=content, calls=calls, errors=errors)
    items = _openai_json(text)
    if items is None:
        return ParsedTurn(content=text)
    parsed = [_make_call(item) for item in items]
    return ParsedTurn(
        content="",
        calls=[c for c in parsed if not isinstance(c, str)],
        errors=[e for e in parsed if isinstance(e, str)],
    )
