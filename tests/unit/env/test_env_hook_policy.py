"""One policy for every environment hook: synchronous hooks run off the event loop, each hook and
the episode have a deadline, and whatever a hook does (raises, hangs, returns garbage, hands the
tokenizer text it refuses) masks its episode with a counted reason that names the hook, the
environment and the task."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from dora.env import Env, Episode, Task
from dora.episode import EpisodeLimits, run_episode
from dora.protocol import Sample, SamplingParams
from dora.serve.history import masked_reason

END = "<|im_end|>"
PARAMS = SamplingParams(max_tokens=50)
TASK = Task("t7", {"question": "2 + 2?"})


class PlainEnv(Env):
    """Plain text; `reward` returns whatever it was given; `step` may sleep (synchronously)."""

    def __init__(self, reward: object = 1.0, *, prompt: object = "Q: 2 + 2?\nA:", sleep_s=0.0):
        self.value = reward
        self.prompt = prompt
        self.sleep_s = sleep_s
        self.threads: list[str] = []

    def reset(self, task: Task) -> str:
        self.threads.append(threading.current_thread().name)
        return self.prompt  # type: ignore[return-value]

    def step(self, messages: object) -> tuple[str, bool]:  # type: ignore[override]
        time.sleep(self.sleep_s)
        return "", True

    def reward(self, episode: Episode) -> object:  # type: ignore[override]
        self.threads.append(threading.current_thread().name)
        return self.value


async def _run(scripted, tokenizer, env: Env, limits: EpisodeLimits | None = None) -> Sample:  # type: ignore[no-untyped-def]
    """One plain-text episode of `env`: the model answers " 4"."""
    return await run_episode(
        sampler=scripted([" 4" + END]),
        tokenizer=tokenizer,
        env=env,
        task=TASK,
        params=PARAMS,
        limits=limits,
    )


@pytest.mark.parametrize(
    "value",
    ["0.5", {"a": "1"}, [1.0], True, None, {"a": True}, float("nan"), {"a": float("inf")}],
    ids=repr,
)
async def test_reward_values_follow_one_rule_strings_refused_everywhere(
    tokenizer, scripted, value
) -> None:
    sample = await _run(scripted, tokenizer, PlainEnv(value))
    assert sample.masked
    error = sample.metadata["error"]
    assert error.startswith("reward returned "), error
    assert error.endswith("(env PlainEnv, task t7)"), error
    assert masked_reason(sample.metadata, sample.finish_reason).startswith("reward returned")


@pytest.mark.parametrize(
    ("value", "total"),
    [(1, 1.0), (np.float32(0.5), 0.5), ({"a": np.int64(1), "b": 0.25}, 1.25)],
    ids=repr,
)
async def test_numbers_of_any_real_type_are_rewards(tokenizer, scripted, value, total) -> None:
    sample = await _run(scripted, tokenizer, PlainEnv(value))
    assert not sample.masked and sample.reward == total


async def test_sync_hooks_run_off_the_loop_and_a_slow_step_is_cut_at_its_deadline(
    tokenizer, scripted
) -> None:
    env = PlainEnv(sleep_s=2.0)
    limits = EpisodeLimits(step_timeout_s=0.2)
    loop = asyncio.get_running_loop()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    began = loop.time()
    sample = await _run(scripted, tokenizer, env, limits)
    ticker.cancel()
    assert loop.time() - began < 1.5, "cut at the step's deadline, not after the sleep"
    assert ticks > 3, "the loop ran while step slept in its thread"
    assert env.threads and all(t.startswith("dora-env") for t in env.threads), env.threads
    assert sample.masked
    assert sample.metadata["error"] == "step timed out after 0.2 s (env PlainEnv, task t7)"
    assert masked_reason(sample.metadata, sample.finish_reason) == "step timed out after 0.2 s"


async def test_the_episode_deadline_masks_an_episode_whose_hook_hangs(tokenizer, scripted) -> None:
    class Hanging(PlainEnv):
        async def reward(self, episode: Episode) -> float:  # type: ignore[override]
            await asyncio.Event().wait()
            return 0.0

    sample = await _run(scripted, tokenizer, Hanging(), EpisodeLimits(episode_timeout_s=0.2))
    assert sample.masked
    assert sample.metadata["error"] == "episode timed out after 0.2 s (env Hanging, task t7)"


@pytest.mark.parametrize("prompt", ["", []], ids=repr)
async def test_an_empty_prompt_is_masked_with_a_clear_reason(tokenizer, scripted, prompt) -> None:
    sample = await _run(scripted, tokenizer, PlainEnv(prompt=prompt))
    assert sample.masked
    assert sample.metadata["error"].startswith("reset() returned an empty prompt")


async def test_a_surrogate_in_a_plain_text_prompt_masks_the_episode(tokenizer, scripted) -> None:
    sample = await _run(scripted, tokenizer, PlainEnv(prompt="Q: 2 + 2?\ud83d\nA:"))
    assert sample.masked
    error = sample.metadata["error"]
    assert error.startswith("encoding reset()'s prompt raised"), error
    assert error.endswith("(env PlainEnv, task t7)")
