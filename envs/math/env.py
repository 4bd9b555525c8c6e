"""Math environments: a question in, a reasoned answer out, scored on the final answer.

`MathEnv` works on any task whose `data` has `question` and `gold` (chain arithmetic, GSM8K,
anything converted to that shape). The prompt asks for the answer after `####`; `\\boxed{}` answers
are accepted too. Scoring is exact match by default (pure, fast, on the event loop).
`scorer="math_verify"` checks symbolic equivalence with math-verify in a process pool with a
timeout; a timeout scores 0.

The process pool outlives the per-episode env objects, so it is shared: pass one as `pool=`, or the
env uses one pool per process, created on first use (`shared_pool()`).
"""

from __future__ import annotations

import logging
from typing import Literal

from dora import ConfigError, Reward, ScorerPool, SingleTurnEnv, Task
from envs.math.answers import exact_match, math_verify_available, math_verify_match

log = logging.getLogger("dora.env.math")

INSTRUCTION = "Solve step by step. Write the final answer on the last line as '#### <answer>'."

_shared: dict[str, ScorerPool] = {}


def shared_pool(*, timeout_s: float = 10.0) -> ScorerPool:
    """The process's math-verify pool (made once: spawning a pool per episode would cost
    seconds)."""
    if "math_verify" not in _shared:
        _shared["math_verify"] = ScorerPool(processes=1, timeout_s=timeout_s)
    return _shared["math_verify"]


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
        self.pool = pool

    def prompt(self, task: Task) -> str:
        question = str(task["question"])
        return f"{question}\n{self.instruction}" if self.instruction else question

    async def score(self, answer: str, task: Task) -> Reward:
        gold = str(task["gold"])
        if self.scorer == "exact":
            return exact_match(answer, gold)
        pool = self.pool or shared_pool()
        try:
            return await pool.run(math_verify_match, answer, gold)
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


class GSM8KEnv(MathEnv):
    """GSM8K-format word problems (`load_gsm8k`)."""
