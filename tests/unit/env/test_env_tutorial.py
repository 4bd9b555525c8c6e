"""The tutorial's environment, executed from docs/environments.md exactly as written (and the same
as examples/guess/guess.py), so the docs cannot drift from the API or the example; and the
PinnedSampler adapter."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from dora.env import Env, Episode, Task
from dora.episode import PinnedSampler, run_episode
from dora.protocol import Completion, SamplingParams
from dora.tools import tool_schema

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "environments.md"
EXAMPLE = ROOT / "examples" / "guess" / "guess.py"


def tutorial_block() -> str:
    text = DOC.read_text()
    block = re.search(r"<!-- tutorial.*?-->\n```python\n(.*?)```", text, re.DOTALL)
    assert block is not None, "the tutorial block is marked in docs/environments.md"
    return block.group(1)


def tutorial_env() -> type[Env]:
    """The first python block after the `<!-- tutorial` marker, executed in a fresh namespace."""
    code = tutorial_block()
    assert len(code.splitlines()) < 70, "the tutorial stays short: under 70 lines"
    namespace: dict[str, object] = {"__name__": "tutorial"}
    exec(compile(code, str(DOC), "exec"), namespace)
    env_cls = namespace["GuessEnv"]
    assert isinstance(env_cls, type) and issubclass(env_cls, Env)
    return env_cls


def guess_turn(n: int) -> str:
    return f'<tool_call>{{"name": "guess", "arguments": {{"number": {n}}}}}</tool_call><|im_end|>'


def test_tutorial_block_is_the_saved_example() -> None:
    """The page shows examples/guess/guess.py as it is: a user who copies either gets the other."""
    assert tutorial_block() == EXAMPLE.read_text()


def test_a_won_game_and_only_a_won_game_counts_as_a_success() -> None:
    """Held-out accuracy counts rewards >= 1.0: every win reaches it, no loss does."""
    GuessEnv = tutorial_env()
    won, lost = GuessEnv(max_guesses=7), GuessEnv(max_guesses=7)
    won.guesses, won.solved = [1] * 7, True
    lost.guesses = [1] * 6
    assert sum(won.reward(None).values()) >= 1.0  # type: ignore[arg-type]
    assert sum(lost.reward(None).values()) < 1.0  # type: ignore[arg-type]


def test_the_demonstration_is_binary_search_ending_with_the_last_guess() -> None:
    """The warm-up's games: guesses halve the range, alternate with the tool's answers, and end
    with the guess that ended the game; with three guesses among ten numbers they win 7 in 10,
    the most any way of guessing can."""
    GuessEnv = tutorial_env()
    lost = []
    for secret in range(1, 11):
        env = GuessEnv(high=10, max_guesses=3)
        env.reset(Task("game"))
        env.secret = secret
        turns = env.demonstration(Task("game"))
        roles = ["assistant", "tool"] * (len(env.guesses) - 1) + ["assistant"]
        assert [t["role"] for t in turns] == roles
        assert env.guesses[0] == 5 and len(env.guesses) <= 3
        if not env.solved:
            lost.append(secret)
    assert lost == [4, 7, 10]


async def test_tutorial_env_plays_a_game_that_its_tool_ends(tokenizer, scripted) -> None:
    """The right guess ends the episode through the `guess` tool: no turn is sampled after it."""
    GuessEnv = tutorial_env()
    secret = random.Random("game-1").randint(1, 100)
    low = secret - 1 if secret > 1 else secret + 1

    episodes: list[Episode] = []

    class Watched(GuessEnv):  # type: ignore[misc,valid-type]
        def reward(self, episode: Episode) -> dict[str, float]:
            episodes.append(episode)
            return super().reward(episode)  # type: ignore[no-any-return]

    turns = [guess_turn(low), "Hmm.<|im_end|>", guess_turn(secret), f"It is {secret}.<|im_end|>"]
    env = Watched()
    assert tool_schema(env.guess)["function"]["parameters"]["properties"] == {  # type: ignore[index]
        "number": {"type": "integer", "description": "your guess, an integer."}
    }
    sampler = scripted(turns)
    sample = await run_episode(
        sampler=sampler,
        tokenizer=tokenizer,
        env=env,
        task=Task("game-1"),
        params=SamplingParams(max_tokens=100),
    )
    assert not sample.masked and sample.finish_reason == "stop"
    assert (sample.num_turns, sample.num_tool_calls, len(sampler.prompts)) == (3, 2, 3)
    assert sample.reward_components == {"solved": 1.0, "spared": pytest.approx(0.1)}
    text = tokenizer.decode(sample.tokens().tolist())
    assert "Keep guessing with the guess tool." in text
    assert ("higher" if low < secret else "lower") in text
    # The tool's last word is the reward's to read, not the model's to answer.
    assert "correct" not in text and text.endswith("</tool_call><|im_end|>")
    (episode,) = episodes
    assert isinstance(episode.messages, list)
    assert episode.messages[-1] == {
        "role": "tool",
        "content": "correct",
        "tool_call_id": episode.messages[-2]["tool_calls"][0]["id"],
        "name": "guess",
    }


async def test_the_last_guess_allowed_ends_the_game_too(tokenizer, scripted) -> None:
    GuessEnv = tutorial_env()
    secret = random.Random("game-2").randint(1, 100)
    wrong = secret - 1 if secret > 1 else secret + 1
    turn = (
        f'<tool_call>{{"name": "guess", "arguments": {{"number": {wrong}}}}}</tool_call><|im_end|>'
    )
    sample = await run_episode(
        sampler=scripted([turn]),
        tokenizer=tokenizer,
        env=GuessEnv(max_guesses=2),
        task=Task("game-2"),
        params=SamplingParams(max_tokens=100),
    )
    assert (sample.finish_reason, sample.num_turns) == ("stop", 2)
    assert sample.reward_components == {"solved": 0.0, "spared": 0.0}


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[list[int], str, int | None]] = []

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        version: int | None = None,
        timeout_s: float | None = None,
    ) -> Completion:
        self.calls.append((prompt_ids, request_id, version))
        return Completion(
            request_id=request_id,
            token_ids=[1],
            logprobs=[-0.5],
            versions=[3],
            finish_reason="stop",
        )


async def test_pinned_sampler_pins_the_version_and_names_requests() -> None:
    client = RecordingClient()
    sampler = PinnedSampler(client, version=3, request_prefix="g7")
    await sampler.generate([5, 6], SamplingParams())
    await sampler.generate([5, 6, 1], SamplingParams())
    (p1, r1, v1), (_, r2, v2) = client.calls
    assert p1 == [5, 6] and v1 == v2 == 3
    assert r1.startswith("g7-") and r1 != r2
