"""Any reasoning-gym dataset as a single-turn environment, scored by the dataset's own checker.

    [env]
    cls = "envs.reasoning_gym:ReasoningGymEnv"
    kwargs = { dataset = "chain_sum", min_terms = 2, max_terms = 3, chat = false }

    [data]
    kwargs = { n = 4000 }               # training problems
    eval_source = "env"
    eval_kwargs = { n = 128 }           # held-out problems, never training questions

`dataset` names the dataset; the other keys that are not this class's own settings (below) are
the dataset's config. The prompt is the dataset's question followed by an instruction that asks
for the answer in `answer_format`:

- "tag" (the default, reasoning-gym's convention): `<answer>...</answer>`; the last such tag of
  the reply is the answer (a reply without one states none).
- "last_line": the last line of the reply that is not blank.

The reward is the dataset's `score_answer(answer, entry)`: 1.0 for a correct answer, and for
some datasets partial credit below 1 (the default checker gives `len(gold) / len(answer)` to an
answer that contains the gold one), so `data.eval_success_at = 1.0` counts correct answers only.
A reply that states no answer scores what the checker gives None, 0.0.

`demonstration(task)` (chat) and the task's `answer` field (plain text) are the dataset's own
answer in the answer format: the reply the supervised warm-up trains on. reasoning-gym gives
final answers, not worked solutions, so by default the warm-up teaches the format and the answers
directly; `solution` names a writer of worked steps to put before the answer
(`envs.reasoning_gym.solutions`: "running_sums" for sums and differences, or "module:function").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dora import ConfigError, Message, SingleTurnEnv, Task
from envs.reasoning_gym.datasets import (
    ANSWER_FORMATS,
    AnswerFormat,
    extract_answer,
    generate_tasks,
    make_dataset,
)
from envs.reasoning_gym.solutions import solution_writer

INSTRUCTIONS: dict[str, str] = {
    "tag": "Give only the final answer, as <answer>answer</answer>.",
    "last_line": "Give the final answer alone on the last line.",
}

OWN_SETTINGS = frozenset(
    {
        "dataset",
        "chat",
        "system_prompt",
        "instruction",
        "answer_format",
        "held_out_share",
        "generator",
        "solution",
    }
)
"""The keyword arguments that are this class's; the other ones are the dataset's config."""


class ReasoningGymEnv(SingleTurnEnv):
    """One reasoning-gym dataset (module doc). Settings:

    - `dataset`: the dataset's name (`envs.reasoning_gym.dataset_names()` lists them);
    - `chat`: a user message rendered with the chat template (True, the default), or plain text;
    - `system_prompt`: a system message in chat mode (none by default);
    - `instruction`: the text after the question; by default it asks for `answer_format`, and
      "" sends the question alone (a model warmed up on the answers knows the format);
    - `answer_format`: "tag" or "last_line" (module doc);
    - `held_out_share`: the share of all questions reserved for held-out splits (0.1);
    - `solution`: the writer of the worked steps the warm-up's replies give before the answer
      (module doc; none by default);
    - every other keyword: the dataset's config.
    """

    def __init__(
        self,
        *,
        dataset: str,
        chat: bool = True,
        system_prompt: str | None = None,
        instruction: str | None = None,
        answer_format: AnswerFormat = "tag",
        held_out_share: float = 0.1,
        generator: Any = None,
        solution: str | None = None,
        **config: object,
    ) -> None:
        if answer_format not in ANSWER_FORMATS:
            raise ConfigError(
                f"env.kwargs.answer_format must be one of {list(ANSWER_FORMATS)}, "
                f"got {answer_format!r}"
            )
        if not 0.0 < held_out_share < 1.0:
            raise ConfigError(
                f"env.kwargs.held_out_share must be above 0 and below 1, got {held_out_share}"
            )
        self.dataset = dataset
        self.chat = chat
        self.system_prompt = system_prompt
        self.instruction = INSTRUCTIONS[answer_format] if instruction is None else instruction
        self.answer_format: AnswerFormat = answer_format
        self.held_out_share = held_out_share
        self.config = dict(config)
        self.solution = None if solution is None else solution_writer(solution)
        self.generator = make_dataset(dataset, config) if generator is None else generator

    @classmethod
    def setup(cls, **kwargs: object) -> Mapping[str, object]:
        """The dataset object, built (and its config checked) once per process: its
        `score_answer` scores every episode."""
        if "generator" in kwargs or not isinstance(kwargs.get("dataset"), str):
            return {}
        config = {k: v for k, v in kwargs.items() if k not in OWN_SETTINGS}
        return {"generator": make_dataset(str(kwargs["dataset"]), config)}

    def tasks(self, split: str, *, n: int = 1000, seed: int = 0, **unknown: object) -> list[Task]:
        """`n` problems of `split`: "train" draws from the training side with `seed`, any other
        split from the held-out side with a seed of its own (`envs.reasoning_gym.datasets`).
        The dataset's config is the environment's (`env.kwargs`), the same for every split."""
        if unknown:
            raise ConfigError(
                f"data.kwargs.{sorted(unknown)[0]}: a reasoning-gym task list takes only n "
                "(its seed is data.seed); the dataset's settings go in env.kwargs"
            )
        return generate_tasks(
            self.dataset,
            self.config,
            split=split,
            n=n,
            seed=seed,
            held_out_share=self.held_out_share,
            answer_format=self.answer_format,
            solution=self.solution,
        )

    def prompt(self, task: Task) -> str:
        question = str(task["question"])
        return f"{question}\n{self.instruction}" if self.instruction else question

    def demonstration(self, task: Task) -> list[Message] | None:
        """The dataset's answer in the answer format, as the assistant's reply (chat); plain
        text has none here: the warm-up reads the task's `answer` field instead."""
        answer = task.data.get("answer")
        if not self.chat or not isinstance(answer, str):
            return None
        return [{"role": "assistant", "content": answer}]

    def score(self, answer: str, task: Task) -> float:
        """reasoning-gym's `score_answer` of the answer the reply states (None if it states
        none)."""
        stated = extract_answer(answer, self.answer_format)
        return float(self.generator.score_answer(stated, task["entry"]))
