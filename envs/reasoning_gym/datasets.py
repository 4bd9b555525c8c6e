"""reasoning-gym's datasets as dora tasks: a dataset by name and config, checked at start-up.

reasoning-gym (0.1.25 up to, not including, 0.2) generates each problem from `(seed, index)`
with the dataset's config and scores an answer with the dataset's own `score_answer(answer,
entry)`. This module is the only place that imports it.

The config is flat: the keyword arguments of the dataset's config dataclass (`chain_sum`:
`min_terms`, `max_terms`, `min_digits`, ...), as TOML scalars and lists; a list becomes a tuple
where the field's default is one (`basic_arithmetic`'s `operators`). `seed` and `size` are not
config here: the task list's seed and length come from the caller (dora's `data.seed` and
`data.kwargs.n`). A name that is not a registered dataset, a key the config does not have, or a
value its `validate()` refuses is a ConfigError naming it, raised when the environment is loaded.

reasoning-gym draws problem `i` from `seed + i`, so the seed dora hands it is a hash of the split's
seed (`dataset_seed`): with the seed as is, seed 1's problems would be seed 0's shifted by one.

Held-out problems are never training problems. A split's problems are drawn with a seed of its
own ("train" from `seed`, any other split from `seed + HELD_OUT_SEED`), and every question is
assigned to one side by a stable hash of its text: a `held_out_share` of all possible questions
belongs to the held-out side, the rest to training, and each split keeps only its own side's
questions. Small problem spaces (two one-digit terms: 200 questions) would otherwise put most
held-out questions in the training set too, and "held-out accuracy" would measure memory.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
from collections.abc import Mapping
from typing import Any, Literal

from dora import ConfigError, Task
from envs.reasoning_gym.solutions import SolutionWriter

HELD_OUT_SEED = 1_000_000
"""Added to the seed of every split but "train"."""

ATTEMPTS_PER_TASK = 100
"""Problems generated per task requested, at most, before a split is declared (nearly) empty."""

AnswerFormat = Literal["tag", "last_line"]
ANSWER_FORMATS: tuple[AnswerFormat, ...] = ("tag", "last_line")


def _registry() -> Mapping[str, tuple[type, type]]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ConfigError(
            "envs.reasoning_gym needs the reasoning-gym package: pip install -e '.[reasoning-gym]' "
            f"({exc})"
        ) from exc
    return DATASETS


def dataset_names() -> list[str]:
    """Every dataset name the installed reasoning-gym registers."""
    return sorted(_registry())


def make_dataset(name: str, config: Mapping[str, object], *, seed: int = 0, size: int = 1) -> Any:
    """reasoning-gym's dataset `name` with `config` (module doc); a ConfigError names what is
    wrong."""
    registry = _registry()
    if name not in registry:
        close = difflib.get_close_matches(name, registry, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(
            f"env.kwargs.dataset = {name!r} is not a reasoning-gym dataset{hint}; "
            f"envs.reasoning_gym.dataset_names() lists the {len(registry)} installed"
        )
    dataset_cls, config_cls = registry[name]
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for key in ("seed", "size"):
        if key in config:
            where = "data.seed" if key == "seed" else "data.kwargs.n (and data.eval_kwargs.n)"
            raise ConfigError(f"env.kwargs.{key}: a reasoning-gym task list's {key} is {where}")
    unknown = sorted(set(config) - set(fields))
    if unknown:
        keys = ", ".join(k for k in fields if k not in ("seed", "size"))
        raise ConfigError(
            f"env.kwargs.{unknown[0]} is not a setting of reasoning-gym's {name!r} "
            f"({config_cls.__name__}); it has: {keys}"
        )
    values = {key: _as_field(value, fields[key]) for key, value in config.items()}
    try:
        cfg = config_cls(**values, seed=seed, size=size)
        if hasattr(cfg, "validate"):
            cfg.validate()
        return dataset_cls(config=cfg)
    except (AssertionError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"reasoning-gym's {name!r} refused env.kwargs {dict(config)}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _as_field(value: object, field: dataclasses.Field[Any]) -> object:
    """TOML has lists, not tuples: a list for a field whose default is a tuple becomes one."""
    default = field.default
    if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    return tuple(value) if isinstance(value, list) and isinstance(default, tuple) else value


def held_out(question: str, share: float) -> bool:
    """Whether `question` belongs to the held-out side (module doc): a stable hash of its text."""
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def dataset_seed(split_seed: int) -> int:
    """The seed reasoning-gym gets for a split seeded `split_seed` (module doc): far from every
    other split seed's, since reasoning-gym seeds problem `i` with `seed + i`."""
    digest = hashlib.sha256(f"dora-split-{split_seed}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 2**31


def format_reply(answer: str, answer_format: AnswerFormat, steps: str | None = None) -> str:
    """The reply that states `answer` in `answer_format`, after the worked `steps` if any (on
    lines of their own): the warm-up's target."""
    stated = f"<answer>{answer}</answer>" if answer_format == "tag" else answer
    return f"{steps}\n{stated}" if steps else stated


def extract_answer(reply: str, answer_format: AnswerFormat) -> str | None:
    """The answer stated in `reply`, or None: "tag" takes the last `<answer>...</answer>`
    (reasoning-gym's own `extract_answer`), "last_line" the last line that is not blank."""
    if answer_format == "tag":
        from reasoning_gym.utils import extract_answer as extract_tag

        found: str | None = extract_tag(reply, tag_name="answer")
        return found
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    return lines[-1] if lines else None


def generate_tasks(
    name: str,
    config: Mapping[str, object],
    *,
    split: str,
    n: int,
    seed: int,
    held_out_share: float,
    answer_format: AnswerFormat,
    solution: SolutionWriter | None = None,
) -> list[Task]:
    """`n` problems of `split`'s side (module doc) as tasks.

    A task's data: `question` (the prompt), `answer` (the reply that states reasoning-gym's
    answer in `answer_format`, after the steps `solution` writes for the entry if given, which
    the warm-up trains on; absent when the entry has none),
    `oracle` (reasoning-gym's answer) and `entry` (the whole entry, which `score_answer` reads).
    """
    if n < 1:
        raise ConfigError(f"n = {n}: a reasoning-gym task list needs at least one task")
    train = split == "train"
    split_seed = seed if train else seed + HELD_OUT_SEED
    attempts = ATTEMPTS_PER_TASK * n + 1000
    dataset = make_dataset(name, config, seed=dataset_seed(split_seed), size=attempts)
    tasks: list[Task] = []
    for index in range(attempts):
        entry = dataset[index]
        question = str(entry["question"])
        if held_out(question, held_out_share) == train:
            continue
        data: dict[str, object] = {"question": question, "oracle": entry.get("answer")}
        if entry.get("answer") is not None:
            steps = solution(entry) if solution is not None else None
            data["answer"] = format_reply(str(entry["answer"]), answer_format, steps)
        data["entry"] = entry
        tasks.append(Task(f"{name}-{split}-{split_seed}-{index}", data))
        if len(tasks) == n:
            return tasks
    raise ConfigError(
        f"reasoning-gym's {name!r} gave only {len(tasks)} {split!r} problems of the {n} asked in "
        f"{attempts} draws (held_out_share = {held_out_share}): its config allows too few distinct "
        "questions for this split; widen the config or change held_out_share"
    )
