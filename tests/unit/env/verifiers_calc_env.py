"""A verifiers environment as a verifiers user writes one (the classic API, as on the Environments
Hub): sums to work out, by default with a calculator tool over several turns (`vf.ToolEnv`), two
weighted rewards; `kind` picks a `vf.SingleTurnEnv` or a `vf.MultiTurnEnv` that answers a wrong
reply with a hint instead; `broken` a reward that returns NaN or text, or one that scores the
whole group. The tests import it by
module name, as `vf.load_environment("verifiers_calc_env")` does."""

import re

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def rows(first: int, count: int) -> Dataset:
    return Dataset.from_list(
        [
            {"question": f"What is {first + i} + 7? Use the tool.", "answer": str(first + i + 7)}
            for i in range(count)
        ]
    )


def last_reply(completion) -> str:
    replies = [m for m in completion if m.role == "assistant"]
    return str(replies[-1].content or "") if replies else ""


class HintEnv(vf.MultiTurnEnv):
    """The user replies to a wrong answer with a hint, until the model gets it or runs out."""

    async def env_response(self, messages, state, **kwargs):
        if state["answer"] in last_reply(messages):
            state["final_env_response"] = [{"role": "user", "content": "Right."}]
            return state["final_env_response"]
        return [{"role": "user", "content": "No. Add 7 to the first number."}]


def load_environment(kind: str = "tool", broken: str = "", max_turns: int = 3):
    def correct(completion, answer) -> float:
        if broken == "nan":
            return float("nan")
        if broken == "text":
            return "1.0"
        return float(answer in re.findall(r"\d+", last_reply(completion)))

    def used_tool(completion) -> float:
        return float(any(m.role == "tool" for m in completion))

    def spread(completions) -> list[float]:
        return [float(i) for i, _ in enumerate(completions)]

    rubric = vf.Rubric(funcs=[correct, used_tool], weights=[1.0, 0.1])
    if broken == "group":
        rubric.add_reward_func(spread)
    data = {"dataset": rows(10, 8), "eval_dataset": rows(30, 4), "rubric": rubric}
    if kind == "tool":
        return vf.ToolEnv(tools=[add], max_turns=max_turns, **data)
    if kind == "multi":
        return HintEnv(max_turns=max_turns, **data)
    return vf.SingleTurnEnv(system_prompt="Answer with the number only.", **data)
