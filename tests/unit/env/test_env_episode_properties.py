"""Property: for any script of tool calls and plain turns written in the template's own format, the
episode's tokens equal the chat-template rendering of the whole conversation, and the loss mask
covers exactly the sampled tokens."""

from __future__ import annotations

import asyncio
import string

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.env import Env, Episode, Message, Task
from dora.episode import ChatRenderer, EpisodeLimits, run_episode
from dora.models.tiny import char_tokenizer
from dora.protocol import Completion, SamplingParams
from dora.tools import tool_schema

pytestmark = pytest.mark.timeout(60)

TOKENIZER = char_tokenizer()
RENDERER = ChatRenderer(TOKENIZER)  # type: ignore[arg-type]
END = "<|im_end|>"


def echo(text: str) -> str:
    """Repeat the text back."""
    return text.upper()


class EchoEnv(Env):
    def __init__(self, replies: list[str]) -> None:
        self.replies = replies
        self.episode: Episode | None = None

    def reset(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": "go"}]

    def tools(self) -> list[object]:
        return [echo]

    def step(self, messages: list[Message] | str) -> tuple[list[Message], bool]:
        if not self.replies:
            return [], True
        return [{"role": "user", "content": self.replies.pop(0)}], False

    def reward(self, episode: Episode) -> float:
        self.episode = episode
        return 0.0


class Script:
    def __init__(self, turns: list[str]) -> None:
        self.turns = turns
        self.sampled: list[int] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        ids = TOKENIZER.encode(self.turns.pop(0), add_special_tokens=False)
        self.sampled += ids
        return Completion(
            request_id="r", token_ids=ids, logprobs=[-1.0] * len(ids), versions=[0] * len(ids),
            finish_reason="stop",
        )  # fmt: skip


words = st.text(alphabet=string.ascii_letters + string.digits + " .,!?\n", min_size=1, max_size=20)
# A raw newline inside a JSON string makes the call malformed (tested in test_env_episode.py).
turn = st.one_of(
    st.builds(lambda w: ("call", w), words.filter(lambda w: "\n" not in w)),
    st.builds(lambda w: ("text", w), words.filter(lambda w: w.strip() == w)),
)


@settings(max_examples=25, deadline=None)
@given(script=st.lists(turn, min_size=1, max_size=6), replies=st.lists(words, max_size=3))
def test_tokens_equal_template_rendering(script: list[tuple[str, str]], replies: list[str]) -> None:
    texts = [
        f'<tool_call>{{"name": "echo", "arguments": {{"text": "{w}"}}}}</tool_call>{END}'
        if kind == "call"
        else f"{w}{END}"
        for kind, w in script
    ]
    texts.append(f"final{END}")
    sampler = Script(list(texts) + [f"extra{END}"] * 10)
    env = EchoEnv(list(replies))
    sample = asyncio.run(
        run_episode(
            sampler=sampler,
            tokenizer=RENDERER,
            env=env,
            task=Task("p"),
            params=SamplingParams(max_tokens=500),
            limits=EpisodeLimits(max_turns=20),
        )
    )
    assert not sample.masked and env.episode is not None
    messages = env.episode.messages
    assert isinstance(messages, list)
    rendered = RENDERER.render(messages, tools=[tool_schema(echo)], add_generation_prompt=False)
    tokens = sample.tokens().tolist()
    assert tokens == TOKENIZER.encode(rendered[: -len("\n")], add_special_tokens=False)
    mask = sample.mask()
    assert np.asarray(tokens)[mask == 1].tolist() == sampler.sampled
