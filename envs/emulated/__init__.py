"""The emulated workload: prompts of the simulator's lengths for emulated instances.

from envs.emulated import WorkloadEnv, workload_tasks
tasks = workload_tasks(4096, prompt_median=150, prompt_sigma=0.5, prompt_max=2048, seed=0)

A task's prompt is plain text (no chat template) of a log-normal number of characters (one token
each with the tiny character tokenizer), distinct per task. An emulated instance decides how long
each sample's answer is (a function of the prompt, the sample index and its seed); the reward is
a deterministic coin over the answer's tokens, so groups have spread and every mode scores the
same answers alike.

`AgenticWorkloadEnv` is the multi-turn form (the simulator's `agentic` preset): after each turn
the environment waits a tool's latency (exponential, mean `tool_latency_s` modelled seconds, times
`time_scale` real seconds) and answers with `tool_tokens` characters; an episode has `1 +
Geometric(1 / turns) - 1` turns, drawn from the first answer (so from the prompt and the sample),
and ends early when its context would pass `context_max`.
"""

from __future__ import annotations

import asyncio
import math
import random
import zlib

from dora import Env, Episode, Message, SingleTurnEnv, Task

__all__ = ["AgenticWorkloadEnv", "WorkloadEnv", "workload_tasks"]

_LETTERS = "abcdefghijklmnopqrstuvwxyz "


def workload_tasks(
    n: int,
    *,
    prompt_median: int = 150,
    prompt_sigma: float = 0.5,
    prompt_max: int = 2048,
    seed: int = 0,
) -> list[Task]:
    """`n` prompts with log-normal lengths (median `prompt_median`, at most `prompt_max`)."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        length = int(
            min(prompt_max, max(8, rng.lognormvariate(math.log(prompt_median), prompt_sigma)))
        )
        head = f"task {i}: "
        body = "".join(rng.choice(_LETTERS) for _ in range(max(0, length - len(head))))
        tasks.append(Task(prompt_id=f"w{i}", data={"prompt": head + body}))
    return tasks


class WorkloadEnv(SingleTurnEnv):
    """Single-turn: the prompt as plain text; reward 0 or 1 from the answer."""

    chat = False

    def score(self, answer: str, task: Task) -> float:
        return float(zlib.crc32(answer.encode()) & 1)


class AgenticWorkloadEnv(Env):
    """Multi-turn: plain-text turns, a tool's latency and its reply between them."""

    def __init__(
        self,
        *,
        turns: float = 6.0,
        tool_latency_s: float = 4.0,
        tool_tokens: int = 400,
        context_max: int = 65536,
        time_scale: float = 1.0,
    ) -> None:
        if turns < 1 or tool_latency_s < 0 or tool_tokens < 0 or time_scale <= 0:
            raise ValueError(
                f"AgenticWorkloadEnv: turns >= 1, tool_latency_s >= 0, tool_tokens >= 0 and "
                f"time_scale > 0, got {turns}, {tool_latency_s}, {tool_tokens}, {time_scale}"
            )
        self.turns = turns
        self.tool_latency_s = tool_latency_s
        self.tool_tokens = tool_tokens
        self.context_max = context_max
        self.time_scale = time_scale
        self._rng: random.Random | None = None
        self._turns_left = 0
        self._text = ""
        """The episode's text so far (`step` gets only the model's new turn)."""

    def reset(self, task: Task) -> str:
        self._text = str(task["prompt"])
        return self._text

    async def step(self, messages: list[Message] | str) -> tuple[str, bool]:
        assert isinstance(messages, str)
        self._text += messages
        if self._rng is None:  # the prompt and the first answer fix the episode's draws
            self._rng = random.Random(zlib.crc32(self._text.encode()))
            extra = 0
            if self.turns > 1:
                p = 1.0 / self.turns
                extra = int(math.log(1.0 - self._rng.random()) / math.log(1.0 - p))
            self._turns_left = extra
        if self._turns_left <= 0 or len(self._text) + self.tool_tokens >= self.context_max:
            return "", True
        self._turns_left -= 1
        await asyncio.sleep(
            self._rng.expovariate(1.0 / self.tool_latency_s) * self.time_scale
            if self.tool_latency_s > 0
            else 0.0
        )
        reply = "".join(self._rng.choices(_LETTERS, k=self.tool_tokens))
        self._text += reply
        return reply, False

    def reward(self, episode: Episode) -> float:
        return float(zlib.crc32(str(episode.completion).encode()) & 1)
