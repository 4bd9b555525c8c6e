"""Hermes tool-call parsing, alone and through the chat renderer with the tiny tokenizer."""

from __future__ import annotations

import json

import pytest

from dora.engine.batcher import Sequence
from dora.engine.render import Renderer
from dora.engine.tool_parser import parse_tool_calls
from dora.models.tiny import char_tokenizer
from dora.protocol import SamplingParams

pytestmark = pytest.mark.timeout(30)


def test_calls_are_parsed_and_removed_from_content() -> None:
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]


def test_two_calls_and_no_content() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content is None and [c.name for c in calls] == ["a", "b"] and calls[1].arguments == "{}"


def test_malformed_calls_stay_text() -> None:
    for text in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>["x"]</tool_call>',
        "<tool_call>{} unclosed",
    ):
        content, calls = parse_tool_calls(text)
        assert calls == [] and content == text


def test_chat_renderer_turns_sampled_tokens_into_tool_calls() -> None:
    tok = char_tokenizer()
    ids = tok.encode('ok<tool_call>{"name": "get", "arguments": {"k": "v"}}</tool_call><|im_end|>')  # type: ignore[attr-defined]
    seq = Sequence(
        id="s", prompt_ids=[1], params=SamplingParams(), key=0, token_ids=ids, finish_reason="stop"
    )
    message, finish = Renderer(tok, [tok.eos_token_id])._message(seq, tools=True)  # type: ignore[attr-defined]
    assert finish == "tool_calls" and message["content"] == "ok"
    call = message["tool_calls"][0]  # type: ignore[index]
    assert call["function"] == {"name": "get", "arguments": '{"k": "v"}'}
