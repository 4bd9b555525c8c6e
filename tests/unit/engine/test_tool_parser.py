"""The engine's chat endpoint and the episode runner read tool calls with one parser.

`Renderer._message` is what `/v1/chat/completions` answers (with tools); `dora.tools.
parse_tool_calls` is what the runner reads from the same sampled text. The property test builds
texts out of the pieces that make parsers disagree (well-formed and malformed hermes blocks,
unclosed blocks, stray tags, OpenAI JSON turns, plain text) and checks that both give the same
calls, and that the endpoint keeps a turn with a malformed call whole in its content.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.engine.responses import Renderer
from dora.engine.sequence import Sequence
from dora.models.tiny import char_tokenizer
from dora.protocol import SamplingParams
from dora.tools import parse_tool_calls

pytestmark = pytest.mark.timeout(60)

_TOK = char_tokenizer()
_RENDERER = Renderer(_TOK, [_TOK.eos_token_id])  # type: ignore[attr-defined]

_names = st.sampled_from(["add", "get", "a_b", ""])
_args = st.dictionaries(
    st.sampled_from(["a", "k", "x"]), st.one_of(st.integers(-5, 5), st.text("xy z", max_size=3))
)
_call_json = st.builds(
    lambda n, a, key, as_text: json.dumps({"name": n, key: json.dumps(a) if as_text else a}),
    _names,
    _args,
    st.sampled_from(["arguments", "parameters"]),
    st.booleans(),
)
_malformed = st.sampled_from(
    ["{oops", '["a"]', '{"arguments": {}}', '{"name": "a", "arguments": "{bad"}', "", "1"]
)
_plain = st.text("ab \n.{}[]\"'", max_size=8)
_piece = st.one_of(
    _plain,
    st.builds(lambda b: f"<tool_call>{b}</tool_call>", st.one_of(_call_json, _malformed)),
    st.builds(lambda b: f"<tool_call>{b}", st.one_of(_call_json, _malformed)),
    st.sampled_from(["<tool_call>", "</tool_call>", "\n"]),
)
_openai_turn = st.builds(
    lambda calls, wrap: (
        json.dumps({"tool_calls": [{"type": "function", "function": c} for c in calls]})
        if wrap
        else json.dumps(calls if len(calls) > 1 else calls[0])
    ),
    st.lists(st.fixed_dictionaries({"name": _names, "arguments": _args}), min_size=1, max_size=2),
    st.booleans(),
)
_texts = st.one_of(st.lists(_piece, max_size=5).map("".join), _openai_turn)


def _endpoint(text: str) -> tuple[dict[str, object], str | None]:
    ids = _TOK.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    seq = Sequence(
        id="s", prompt_ids=[1], params=SamplingParams(), key=0, token_ids=ids, finish_reason="stop"
    )
    return _RENDERER._message(seq, tools=True)


def _calls(calls: object) -> list[tuple[str, object]]:
    assert isinstance(calls, list)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@settings(max_examples=300, deadline=None)
@given(_texts)
def test_endpoint_and_runner_read_the_same_tool_calls(text: str) -> None:
    message, finish = _endpoint(text)
    turn = parse_tool_calls(text)
    assert _calls(message.get("tool_calls", [])) == _calls(turn.calls)
    assert finish == ("tool_calls" if turn.calls else "stop")
    if turn.errors:
        # the runner answers a malformed call with a tool error; an OpenAI client gets the text
        assert message["content"] == text
    else:
        assert message["content"] == (turn.content or None)


def test_calls_are_parsed_and_removed_from_content() -> None:
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    message, finish = _endpoint(text)
    assert finish == "tool_calls" and message["content"] == "Let me add."
    assert _calls(message["tool_calls"]) == [("add", {"a": 1, "b": 2})]


def test_an_unclosed_final_call_is_a_call_at_the_endpoint_too() -> None:
    message, _ = _endpoint('<tool_call>{"name": "a", "arguments": {}}')
    assert message["content"] is None and _calls(message["tool_calls"]) == [("a", {})]


def test_a_malformed_call_keeps_the_whole_turn_as_content() -> None:
    text = 'ok<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
    message, finish = _endpoint(text)
    assert message["content"] == text and finish == "tool_calls"
    assert _calls(message["tool_calls"]) == [("a", {})]
    turn = parse_tool_calls(text)
    assert len(turn.errors) == 1 and "not valid JSON" in turn.errors[0]


def test_chat_renderer_turns_sampled_tokens_into_tool_calls() -> None:
    ids = _TOK.encode('ok<tool_call>{"name": "get", "arguments": {"k": "v"}}</tool_call><|im_end|>')  # type: ignore[attr-defined]
    seq = Sequence(
        id="s", prompt_ids=[1], params=SamplingParams(), key=0, token_ids=ids, finish_reason="stop"
    )
    message, finish = _RENDERER._message(seq, tools=True)
    assert finish == "tool_calls" and message["content"] == "ok"
    call = message["tool_calls"][0]  # type: ignore[index]
    assert call["function"] == {"name": "get", "arguments": '{"k": "v"}'}


def test_without_tools_the_text_is_content() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    ids = _TOK.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    seq = Sequence(
        id="s", prompt_ids=[1], params=SamplingParams(), key=0, token_ids=ids, finish_reason="stop"
    )
    message, finish = _RENDERER._message(seq, tools=False)
    assert message == {"role": "assistant", "content": text} and finish == "stop"
