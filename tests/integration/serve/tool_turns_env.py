"""A multi-turn tool environment for the runner tests: chain arithmetic in three turns.

After each model turn that calls no tool the environment answers with what its `add` tool
computes (a partial sum of the task) and asks for the next turn, until three turns are done; the
model may call `add` itself too. A tiny untrained model writes no tool calls, so the turns are the
environment's, and every episode has three model calls whatever the model writes. Imported by
`dora run`'s processes and the runners (`env.cls =
"tests.integration.serve.tool_turns_env:ToolTurnsEnv"`, with the checkout on `PYTHONPATH`).
"""

from __future__ import annotations

from collections.abc import Callable

from dora import Message, Reply
from envs.math import ChainArithmeticEnv

TURNS = 3


class ToolTurnsEnv(ChainArithmeticEnv):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.turns = 0

    def tools(self) -> list[Callable[..., object]]:
        return [self.add]

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: the first integer.
            b: the second integer.
        """
        return str(a + b)

    def step(self, messages: list[Message] | str) -> Reply:
        self.turns += 1
        if self.turns >= TURNS:
            return [], True
        reply: list[Message] = [{"role": "user", "content": f"add says {self.add(self.turns, 1)}"}]
        return reply, False
