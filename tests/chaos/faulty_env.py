"""An environment that fails as user code does, for the chaos run: each fault in about one call
of its hook in twenty (a synchronous sleep, which only slows, in one in ten), drawn from a seeded
generator per process.

- `reset` raises;
- `step` sleeps synchronously (0.5 s) before it ends the episode;
- `reward` raises, never returns, returns NaN, a string, a list.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

from dora import Episode, Reply, Task
from envs.math import ChainArithmeticEnv

RATE = 0.05
"""Chance of each failing fault per call (five in `reward`: a quarter of episodes fail there)."""
SLEEP_RATE = 0.1

_rng = random.Random(int(os.environ.get("DORA_CHAOS_ENV_SEED", "0")))


class FaultyEnv(ChainArithmeticEnv):
    def reset(self, task: Task) -> object:  # type: ignore[override]
        if _rng.random() < RATE:
            raise RuntimeError(f"reset failed on {task.prompt_id}")
        return super().reset(task)

    def step(self, messages: object) -> Reply:  # type: ignore[override]
        if _rng.random() < SLEEP_RATE:
            time.sleep(0.5)  # a synchronous scorer or simulator: must not hold serve's loop
        return [], True

    async def reward(self, episode: Episode) -> object:  # type: ignore[override]
        fault = int(_rng.random() / RATE)
        if fault == 0:
            raise ValueError("scorer crashed")
        if fault == 1:
            await asyncio.Event().wait()  # never returns: cut at env.reward_timeout_s
        if fault == 2:
            return float("nan")
        if fault == 3:
            return "0.5"
        if fault == 4:
            return [1.0]
        return await super().reward(episode)  # type: ignore[misc]
