"""Tool schemas from signatures and docstrings, tool calls parsed from sampled text, and ToolBox."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

import pytest

from dora.tools import (
    CallId,
    EndEpisode,
    Tool,
    ToolBox,
    ToolCall,
    ToolResult,
    parse_tool_calls,
    tool_schema,
)

pytestmark = pytest.mark.timeout(30)


def search(
    query: Annotated[str, "What to look for."],
    limit: int = 5,
    mode: Literal["fast", "exact"] = "fast",
    tags: list[str] | None = None,
) -> list[str]:
    """Search the catalogue.

    Results are ranked.

    Args:
        limit (int): How many results
            to return at most.
        mode: Search strategy.

    Returns:
        The matching titles.
    """
    return [query] * limit


def test_schema_from_signature_and_docstring() -> None:
    schema = tool_schema(search)
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "search"  # type: ignore[index]
    assert fn["description"] == "Search the catalogue.\n\nResults are ranked."  # type: ignore[index]
    assert fn["parameters"] == {  # type: ignore[index]
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for."},
            "limit": {"type": "integer", "description": "How many results to return at most."},
            "mode": {"enum": ["fast", "exact"], "description": "Search strategy."},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["query"],
    }


def test_schema_rejects_what_a_model_cannot_be_told() -> None:
    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    def variadic(*xs: int) -> int:
        return 0

    with pytest.raises(TypeError, match="needs a type annotation"):
        tool_schema(untyped)
    with pytest.raises(TypeError, match=r"\*args"):
        tool_schema(variadic)


def test_parse_hermes_calls_keeps_content_and_order() -> None:
    text = (
        'Thinking. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    turn = parse_tool_calls(text)
    assert turn.content == "Thinking."
    assert [c["function"]["name"] for c in turn.calls] == ["a", "b"]
    assert [json.loads(c["function"]["arguments"]) for c in turn.calls] == [{"x": 1}, {"y": 2}]
    assert len({c["id"] for c in turn.calls}) == 2 and not turn.errors


def test_parse_hermes_tolerates_a_missing_final_close_tag() -> None:
    turn = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}')
    assert [c["function"]["name"] for c in turn.calls] == ["a"]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{oops</tool_call>", "not valid JSON"),
        ('<tool_call>["a"]</tool_call>', "expected a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'missing "name"'),
        ('<tool_call>{"name": "a", "arguments": "{bad"}</tool_call>', "is not valid JSON"),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ],
)
def test_parse_malformed_hermes_calls(text: str, error: str) -> None:
    turn = parse_tool_calls(text)
    assert not turn.calls
    assert len(turn.errors) == 1 and error in turn.errors[0]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "a", "arguments": {"x": 1}}',
        '[{"name": "a", "arguments": {"x": 1}}]',
        '{"tool_calls": [{"type": "function", '
        '"function": {"name": "a", "arguments": "{\\"x\\": 1}"}}]}',
        ' {"function": {"name": "a", "arguments": {"x": 1}}} ',
    ],
)
def test_parse_openai_json_calls(text: str) -> None:
    turn = parse_tool_calls(text)
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.calls
    ] == [("a", {"x": 1})]


@pytest.mark.parametrize("text", ['{"answer": 42}', "The answer is 42.", "[1, 2]", "{"])
def test_plain_answers_are_not_tool_calls(text: str) -> None:
    turn = parse_tool_calls(text)
    assert turn.content == text and not turn.calls and not turn.errors


async def test_toolbox_converts_arguments_and_reports_errors() -> None:
    box = ToolBox([search], timeout_s=1.0)
    assert len(box) == 1 and box.schemas == [tool_schema(search)]

    def make(args: str) -> object:
        return {"id": "c1", "type": "function", "function": {"name": "search", "arguments": args}}

    assert await box.call(make('{"query": "x", "limit": 2}')) == ToolResult('["x", "x"]', True)  # type: ignore[arg-type]
    content, ok, _ = await box.call(make('{"limit": 2}'))  # type: ignore[arg-type]
    assert not ok and "missing required field `query`" in content
    content, ok, _ = await box.call(make('{"query": "x", "mode": "slow"}'))  # type: ignore[arg-type]
    assert not ok and "bad arguments" in content
    content, ok, _ = await box.call(make('{"query": "x", "extra": 1}'))  # type: ignore[arg-type]
    assert not ok and "unknown field `extra`" in content


async def test_toolbox_times_out_async_tools_and_stays_usable() -> None:
    async def wait(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "woke"

    box = ToolBox([wait], timeout_s=0.05)
    call = {"id": "c", "type": "function", "function": {"name": "wait", "arguments": ""}}
    call["function"]["arguments"] = '{"seconds": 5}'  # type: ignore[index]
    assert await box.call(call) == ToolResult("Error: tool 'wait' timed out after 0.05 s", False)  # type: ignore[arg-type]
    call["function"]["arguments"] = '{"seconds": 0}'  # type: ignore[index]
    assert await box.call(call) == ToolResult("woke", True)  # type: ignore[arg-type]


def test_duplicate_tool_names_are_refused() -> None:
    with pytest.raises(TypeError, match="two tools"):
        ToolBox([search, search])


def tool_call(name: str, args: object, call_id: str = "c1") -> ToolCall:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


BOOK_SCHEMA: dict[str, object] = {
    "type": "function",
    "function": {
        "name": "book",
        "description": "Book a flight.",
        "parameters": {
            "type": "object",
            "properties": {
                "flight": {"type": "string"},
                "passengers": {"type": "array", "items": {"type": "object"}},
            },
            "required": ["flight"],
        },
    },
}


async def test_a_ready_made_schema_is_sent_as_is_and_its_callable_gets_the_arguments() -> None:
    got: list[dict[str, object]] = []

    async def book(**arguments: object) -> dict[str, object]:
        got.append(arguments)
        return {"booked": arguments["flight"]}

    box = ToolBox([Tool(schema=BOOK_SCHEMA, fn=book)])
    assert box.schemas == [BOOK_SCHEMA]
    passengers = [{"name": "Ada", "dob": "1815-12-10"}]
    args = {"flight": "HAT001", "passengers": passengers}
    assert await box.call(tool_call("book", args)) == ToolResult('{"booked": "HAT001"}', True)
    assert got == [args]  # nested objects arrive as the model wrote them
    content, ok, _ = await box.call(tool_call("book", {"passengers": []}))
    assert not ok and "missing required argument(s) 'flight'" in content
    content, ok, _ = await box.call(tool_call("book", {"flight": "X", "seat": "1A"}))
    assert not ok and "unknown argument(s) 'seat'" in content
    content, ok, _ = await box.call(tool_call("book", ["HAT001"]))
    assert not ok and "must be a JSON object" in content
    assert len(got) == 1  # refused calls never reach the tool


async def test_a_ready_made_schema_may_allow_extra_arguments_and_be_the_bare_function() -> None:
    inner = {
        "name": "note",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": True},
    }
    box = ToolBox([Tool(schema=inner, fn=lambda **kw: sorted(kw))])
    assert box.schemas == [{"type": "function", "function": inner}]
    assert await box.call(tool_call("note", {"b": 1, "a": 2})) == ToolResult('["a", "b"]', True)
    with pytest.raises(TypeError, match="no function name"):
        ToolBox([Tool(schema={"type": "function", "function": {}}, fn=print)])


async def test_tools_receive_their_call_id_outside_the_schema() -> None:
    seen: list[tuple[str, str]] = []

    def lookup(key: str, call_id: CallId) -> str:
        """Look a key up.

        Args:
            key: what to look up.
        """
        seen.append((key, call_id))
        return key.upper()

    def book(call_id: CallId, **arguments: object) -> str:
        seen.append((str(arguments["flight"]), call_id))
        return "ok"

    schema = tool_schema(lookup)
    assert schema["function"]["parameters"] == {  # type: ignore[index]
        "type": "object",
        "properties": {"key": {"type": "string", "description": "what to look up."}},
        "required": ["key"],
    }
    box = ToolBox([lookup, Tool(schema=BOOK_SCHEMA, fn=book)])
    assert await box.call(tool_call("lookup", {"key": "a"}, "call_7")) == ToolResult("A", True)
    assert await box.call(tool_call("book", {"flight": "F1"}, "call_8")) == ToolResult("ok", True)
    assert seen == [("a", "call_7"), ("F1", "call_8")]
    content, ok, _ = await box.call(tool_call("lookup", {"key": "a", "call_id": "forged"}))
    assert not ok and "unknown field `call_id`" in content  # the model cannot set it

    clash = {"name": "f", "parameters": {"type": "object", "properties": {"call_id": {}}}}
    with pytest.raises(TypeError, match="both an argument and CallId"):
        ToolBox([Tool(schema=clash, fn=book)])


async def test_a_tool_that_returns_end_episode_says_so_with_its_result() -> None:
    def submit(answer: int) -> str | EndEpisode:
        """Submit the answer.

        Args:
            answer: the final answer.
        """
        return EndEpisode({"accepted": answer}) if answer == 42 else "try again"

    async def resign() -> EndEpisode:
        """Give up."""
        return EndEpisode()

    box = ToolBox([submit, resign])
    assert await box.call(tool_call("submit", {"answer": 7})) == ("try again", True, False)
    assert await box.call(tool_call("submit", {"answer": 42})) == ('{"accepted": 42}', True, True)
    assert await box.call(tool_call("resign", {})) == ("", True, True)
