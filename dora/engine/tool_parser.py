"""Hermes-style tool calls in generated text -> OpenAI `tool_calls`.

The model calls a tool by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
chat template of dora.models.tiny, Qwen and Hermes models). Every well-formed block becomes one
call; what is left, stripped, is the message content (None if empty). A block whose body is not a
JSON object with a string `name` stays in the content untouched: a malformed call is text, and the
environment decides.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """JSON text of the arguments object, as OpenAI sends it."""
    id: str

    def to_openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split generated text into (content, tool calls)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _parse_one(match.group(1))
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


def _parse_one(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(name=obj["name"], arguments=arguments, id=f"call_{uuid.uuid4().hex[:24]}")
