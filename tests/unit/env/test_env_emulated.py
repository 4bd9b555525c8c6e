"""The emulated agentic workload over the runner: its draws come from the prompt and the first
answer, every turn is answered with `tool_tokens` characters, and its context bound ends it."""

from __future__ import annotations

import math
import random
import zlib

import pytest

from dora.env import Task
from dora.episode import EpisodeLimits, run_episode
from dora.protocol import SamplingParams
from envs.emulated import AgenticWorkloadEnv

pytestmark = pytest.mark.timeout(30)

TASK = Task("w0", {"prompt": "task 0: abc"})


def expected_turns(text: str, turns: float) -> int:
    rng = random.Random(zlib.crc32(text.encode()))
    p = 1.0 / turns
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


async def test_agentic_turns_are_drawn_from_the_prompt_and_the_first_answer(
    tokenizer, scripted
) -> None:
    answer = " xy"
    env = AgenticWorkloadEnv(turns=4.0, tool_latency_s=0.0, tool_tokens=5)
    sample = await run_episode(
        sampler=scripted([answer]),
        tokenizer=tokenizer,
        env=env,
        task=TASK,
        params=SamplingParams(max_tokens=8),
        limits=EpisodeLimits(max_turns=50, max_total_tokens=10_000, context_limit=10_000),
    )
    turns = expected_turns(TASK["prompt"] + answer, 4.0)  # type: ignore[operator]
    assert (sample.finish_reason, sample.num_turns) == ("stop", turns)
    text = tokenizer.decode(sample.tokens().tolist())  # type: ignore[attr-defined]
    assert len(text) == len("task 0: abc") + turns * len(answer) + (turns - 1) * 5


async def test_agentic_context_bound_ends_the_episode(tokenizer, scripted) -> None:
    env = AgenticWorkloadEnv(turns=1000.0, tool_latency_s=0.0, tool_tokens=20, context_max=60)
    sample = await run_episode(
        sampler=scripted([" xy"]),
        tokenizer=tokenizer,
        env=env,
        task=TASK,
        params=SamplingParams(max_tokens=8),
        limits=EpisodeLimits(max_turns=50, max_total_tokens=10_000, context_limit=10_000),
    )
    # 11 prompt characters, then 3 + 20 per turn: the third turn's reply would pass 60.
    assert (sample.finish_reason, sample.num_turns) == ("stop", 3)
