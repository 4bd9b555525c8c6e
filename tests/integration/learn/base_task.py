"""A completion-style task for a base model, written as a new user writes one: a plain-text
prompt, only `reset` and `reward` (the default `step` ends the episode), tasks from a function.
Imported by `dora run`'s two processes (`env.cls = "base_task:SumEnv"`, with this folder on
`PYTHONPATH`)."""

from __future__ import annotations

import random

from dora import Env, Episode, Message, Task


class SumEnv(Env):
    def reset(self, task: Task) -> str:
        return prompt_of(task)

    def reward(self, episode: Episode) -> float:
        return 1.0 if episode.completion.strip().startswith(str(episode.task["answer"])) else 0.0


class ChatSumEnv(SumEnv):
    """The same task as a chat: wrong for a base model without a chat template."""

    def reset(self, task: Task) -> list[Message]:  # type: ignore[override]
        return [{"role": "user", "content": prompt_of(task)}]


def prompt_of(task: Task) -> str:
    return f"{task['a']}+{task['b']}="


def sum_tasks(n: int = 64, seed: int = 0) -> list[Task]:
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        tasks.append(Task(f"s{seed}-{i}", {"a": a, "b": b, "answer": str(a + b)}))
    return tasks
