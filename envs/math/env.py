"""Math environments: a question in, a reasoned answer out, scored on the final answer.

`MathEnv` works on any task whose `data` has `question` and `gold` (chain arithmetic, GSM8K,
anything converted to that shape). The prompt asks for the answer after `####`; `\\boxed{}` answers
are accepted too. Scoring is exact match by default (pure, fast, on the event loop).
`scorer="math_verify"` checks symbolic equivalence with math-verify in a process pool with a
timeout; a timeout scores 0.

The process pool outlives the per-episode env objects, so it is shared: `MathEnv.setup` makes one
per process for `load_env` to give every episode (dora's commands), or pass your own as `pool=`.
An object built directly without one makes its own, on first use, and closes it in `close()`.

`ChainArithmeticEnv` brings its own tasks (`data.source = "env"`): `chain_arithmetic_tasks` with
`data.kwargs`, held-out splits on a seed of their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Literal

from dora import ConfigError, Reward, ScorerPool, SingleTurnEnv, Task
from envs.math.answers import exact_match, math_verify_available, math_verify_match
from envs.math.chain import chain_arithmetic_tasks

log = logging.getLogger("dora.env.math")

INSTRUCTION = "Solve step by step. Write the final answer on the last line as '#### <answer>'."

HELD_OUT_SEED = 1_000_000
"""Added to the seed of every split but "train": held-out chains are drawn apart from training's."""


class MathEnv(SingleTurnEnv):
    """Single-turn math with exact or math-verify scoring; the task needs `question` and `gold`."""

    def __init__(
        self,
        *,
        instruction: str = INSTRUCTION,
        system_prompt: str | None = None,
        scorer: Literal["exact", "math_verify"] = "exact",
        pool: ScorerPool | None = None,
    ) -> None:
        if scorer not in ("exact", "math_verify"):
            raise ConfigError(f"scorer must be 'exact' or 'math_verify', got {scorer!r}")
        if scorer == "math_verify" and not math_verify_available():
            raise ConfigError(
                "scorer='math_verify' needs the math-verify package: pip install 'math-verify'; "
                "or use scorer='exact'"
            )
        self.instruction = instruction
        self.system_prompt = system_prompt
        self.scorer = scorer
        self._own_pool = pool is None and scorer == "math_verify"
        self.pool = ScorerPool(processes=1) if self._own_pool else pool

    @classmethod
    def setup(cls, **kwargs: object) -> Mapping[str, object]:
        """One math-verify process pool for every episode of the process (spawning one per
        episode would cost seconds)."""
        if kwargs.get("scorer") == "math_verify" and kwargs.get("pool") is None:
            return {"pool": ScorerPool(processes=1)}
        return {}

    async def close(self) -> None:
        if self._own_pool and self.pool is not None:
            await asyncio.to_thread(self.pool.close)

    def prompt(self, task: Task) -> str:
        question = str(task["question"])
        return f"{question}\n{self.instruction}" if self.instruction else question

    async def score(self, answer: str, task: Task) -> Reward:
        gold = str(task["gold"])
        if self.scorer == "exact":
            return exact_match(answer, gold)
        assert self.pool is not None
        try:
            return await self.pool.run(math_verify_match, answer, gold)
        except TimeoutError:
            log.warning("math-verify timed out on prompt %r; scoring 0", task.prompt_id)
            return 0.0


class ChainArithmeticEnv(MathEnv):
    """Chain arithmetic (`chain_arithmetic_tasks`): write each partial sum, then `#### <answer>`."""

    def __init__(
        self,
        *,
        instruction: str = "Write each partial sum on its own line, then '#### <answer>'.",
        system_prompt: str | None = None,
    ) -> None:
        super().__init__(instruction=instruction, system_prompt=system_prompt)

    def tasks(self, split: str, *, seed: int = 0, **kwargs: Any) -> list[Task]:
        """`chain_arithmetic_tasks(seed=..., **kwargs)` (`data.kwargs`: `n`, `max_terms`, ...);
        a split other than "train" is drawn from `seed + HELD_OUT_SEED`."""
        seed = seed if split == "train" else seed + HELD_OUT_SEED
        return chain_arithmetic_tasks(seed=seed, **kwargs)


class GSM8KEnv(MathEnv):
    """GSM8K-format word problems (`load_gsm8k`)."""
