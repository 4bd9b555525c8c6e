"""Worked solutions for the supervised warm-up: the steps before a reasoning-gym answer.

reasoning-gym gives a final answer per problem, not the way to it. A model warmed up on final
answers alone learns to state answers, and RL from there has little to correct step by step; a
warm-up on worked solutions teaches a procedure whose steps RL can then make right more often.
`ReasoningGymEnv(solution=...)` names the writer: "running_sums" (below) or "module:function",
any function `(entry) -> str | None` of a reasoning-gym entry; None leaves that entry's reply the
final answer alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, cast

from dora import ConfigError, load_object

SolutionWriter = Callable[[Mapping[str, Any]], "str | None"]

_TERM = re.compile(r"\s*([+-])\s*(-?\d+)")


def running_sums(entry: Mapping[str, Any]) -> str | None:
    """The running sum after each term of the entry's `metadata.expression`, one line a step
    (`4 - 1 = 3`, `3 + 7 = 10`, ...), for an expression of integers joined by `+` and `-`
    (`chain_sum`, `basic_arithmetic` with those operators); None for any other expression."""
    metadata = entry.get("metadata")
    expression = metadata.get("expression") if isinstance(metadata, Mapping) else None
    if not isinstance(expression, str):
        return None
    expression = expression.strip()
    head = re.match(r"-?\d+", expression)
    if head is None:
        return None
    total, position, lines = int(head.group()), head.end(), []
    while position < len(expression):
        step = _TERM.match(expression, position)
        if step is None:
            return None
        op, term = step.group(1), int(step.group(2))
        new = total + term if op == "+" else total - term
        lines.append(f"{total} {op} {term} = {new}")
        total, position = new, step.end()
    return "\n".join(lines) if lines else None


WRITERS: dict[str, SolutionWriter] = {"running_sums": running_sums}


def solution_writer(name: str) -> SolutionWriter:
    """The writer `name` names: a built-in one (`WRITERS`) or "module:function"."""
    if name in WRITERS:
        return WRITERS[name]
    if ":" not in name:
        raise ConfigError(
            f"env.kwargs.solution = {name!r} is neither a built-in writer ({', '.join(WRITERS)}) "
            "nor 'module:function'"
        )
    writer = load_object(name)
    if not callable(writer):
        raise ConfigError(f"env.kwargs.solution = {name!r} is not callable")
    return cast(SolutionWriter, writer)
