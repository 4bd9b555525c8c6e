"""Chain arithmetic: generated problems whose worked solutions have long-tailed lengths.

A problem is a chain of `n` small terms joined by `+` and `-`; the worked solution writes every
partial sum on its own line and ends with `#### <answer>` (GSM8K's format):

    Compute 7 + 2 - 5
    7 + 2 = 9
    9 - 5 = 4
    #### 4

Solution length grows linearly with `n`, and `n` is drawn from a discrete Pareto law (shape
`alpha`), so most problems are short and a few are very long, like the reasoning lengths of real
math RL (DAPO's mean is about 2.4K tokens with a 30K tail). That tail is what makes rollout straggle
and what dora's scheduling has to absorb; a generator with uniform lengths would hide it. Terms stay
small so tiny models can learn the task on a CPU. Generation is pure and seeded: the same arguments
give the same tasks with the same `prompt_id`s.
"""

from __future__ import annotations

import random

from dora import Task


def _num_terms(rng: random.Random, *, alpha: float, min_terms: int, max_terms: int) -> int:
    return min(max_terms, min_terms - 1 + int(rng.paretovariate(alpha)))


def chain_problem(terms: list[int], ops: list[str]) -> tuple[str, str, int]:
    """(expression, worked solution ending in `#### answer`, answer) for a chain of terms."""
    expression = " ".join(
        [str(terms[0]), *(f"{op} {t}" for op, t in zip(ops, terms[1:], strict=True))]
    )
    lines = []
    total = terms[0]
    for op, term in zip(ops, terms[1:], strict=True):
        new = total + term if op == "+" else total - term
        lines.append(f"{total} {op} {term} = {new}")
        total = new
    lines.append(f"#### {total}")
    return expression, "\n".join(lines), total


def chain_arithmetic_tasks(
    n: int = 4096,
    *,
    seed: int = 0,
    alpha: float = 1.3,
    min_terms: int = 2,
    max_terms: int = 200,
    max_value: int = 9,
) -> list[Task]:
    """`n` chain-arithmetic tasks. `data` holds `question`, `answer` (the worked solution, GSM8K
    format), `gold` (the final answer as text) and `num_terms`."""
    if not (2 <= min_terms <= max_terms) or alpha <= 0 or max_value < 1:
        raise ValueError(
            f"need 2 <= min_terms <= max_terms and alpha > 0, max_value >= 1; got "
            f"min_terms={min_terms}, max_terms={max_terms}, alpha={alpha}, max_value={max_value}"
        )
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        k = _num_terms(rng, alpha=alpha, min_terms=min_terms, max_terms=max_terms)
        terms = [rng.randint(1, max_value) for _ in range(k)]
        ops = [rng.choice("+-") for _ in range(k - 1)]
        expression, solution, total = chain_problem(terms, ops)
        tasks.append(
            Task(
                f"chain-{seed}-{i}",
                {
                    "question": f"Compute {expression}",
                    "answer": solution,
                    "gold": str(total),
                    "num_terms": k,
                },
            )
        )
    return tasks
