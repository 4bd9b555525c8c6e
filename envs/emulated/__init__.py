"""The emulated workload: prompts of the simulator's lengths for emulated instances.

from envs.emulated import WorkloadEnv, workload_tasks
tasks = workload_tasks(4096, prompt_median=150, prompt_sigma=0.5, prompt_max=2048, seed=0)

A task's prompt is plain text (no chat template) of a log-normal number of characters (one token
each with the tiny character tokenizer), distinct per task. An emulated instance decides how long
each sample's answer is (a function of the prompt, the sample index and its seed); the reward is
a deterministic coin over the answer's tokens, so groups have spread and every mode scores the
same answers alike.
"""

from __future__ import annotations

import math
import random
import zlib

from dora import SingleTurnEnv, Task

__all__ = ["WorkloadEnv", "workload_tasks"]

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
