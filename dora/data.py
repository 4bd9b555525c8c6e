"""Where a run's tasks come from: the environment itself, a dataset file, or a function.

`data.source` is one of
- `"env"` (the default): the environment's own tasks, `env.tasks(data.split, **data.kwargs)` on an
  object built from `env.cls` and `env.kwargs` (tau2's domains, generated chain arithmetic);
- a file (`.jsonl`, `.json` or `.parquet`, read with `datasets`; each row becomes a `Task` whose
  `prompt_id` is the row's `id` field or `<file stem>-<row number>`);
- `"module:function"`: a function returning tasks, called with `data.kwargs`.
A task function or `env.tasks` gets `seed=data.seed` too when it takes a `seed`. The held-out set
for evaluation comes the same way from `data.eval_source`, `data.eval_split` and
`data.eval_kwargs`. A bad row is an error naming the file and the row.

A task whose opening prompt (its `reset()` rendered with the chat template and the tool schemas)
does not fit the context is skipped at load by `fit_context`, with one warning that names every
such row and its length, and counted; only when no task fits is it an error. Such a row can never
be sampled: run, it would be a masked group every epoch (rollout work for nothing, and a training
slot without gradient), and refusing the whole dataset over a few long-tail rows (public math sets
have them) would stop a run that is otherwise fine. The skipped rows are named, never hidden.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from dora.env import AgentEnv, Env, Message, Prompt, Task, load_object
from dora.errors import ChatTemplateMissing, ConfigError, DataError
from dora.hooks import HookTimeout, OffLoop, call_hook
from dora.tools import JSON, tool_schema

if TYPE_CHECKING:
    from dora.config import DataConfig

log = logging.getLogger("dora.data")

FILE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


ENV_SOURCE = "env"
"""The `data.source` that names the environment's own tasks (`Env.tasks`)."""


def load_tasks(
    source: str,
    *,
    kwargs: Mapping[str, object] | None = None,
    seed: int = 0,
    key: str = "data.source",
    env_factory: Callable[[], Env] | None = None,
    split: str = "train",
) -> list[Task]:
    """The tasks `source` names; `key` is the config key quoted in errors. `source = "env"` reads
    `env_factory()`'s own tasks of `split`."""
    if not source:
        raise ConfigError(
            f"{key} is empty: set it to 'env' (the environment's own tasks), a dataset file "
            "(.jsonl/.json/.parquet) or 'module:function' returning tasks, e.g. "
            "'envs.math:chain_arithmetic_tasks'"
        )
    if source == ENV_SOURCE:
        if env_factory is None:
            raise ConfigError(f"{key} = 'env' names the environment's tasks, but there is no env")
        env = env_factory()
        name = f"{type(env).__module__}:{type(env).__qualname__}"
        what = f"{key} = 'env' ({name}.tasks, split {split!r})"
        tasks = _call(what, functools.partial(env.tasks, split), kwargs, seed)
        if tasks is None:
            raise ConfigError(
                f"{key} = 'env', but {name} has no tasks of its own (its tasks() returns None): "
                "set it to a dataset file or to 'module:function' returning tasks"
            )
        return _checked(what, tasks)
    path = Path(source)
    if path.suffix in FILE_SUFFIXES:
        if kwargs:
            raise ConfigError(f"{key} is a file; its kwargs {dict(kwargs)} would be ignored")
        return _read_file(path, key=key)
    if ":" not in source:
        raise ConfigError(
            f"{key} = {source!r} is neither 'env', a dataset file nor 'module:function'"
        )
    fn = load_object(source)
    if not callable(fn):
        raise ConfigError(f"{key} = {source!r} is not callable")
    what = f"{key} = {source!r}"
    return _checked(what, _call(what, fn, kwargs, seed))


def config_tasks(
    data: DataConfig, env_factory: Callable[[], Env], *, held_out: bool = False
) -> list[Task]:
    """The training tasks of a config's `data` section, or with `held_out` its first `eval_size`
    held-out tasks (from `eval_source`, `eval_split`, `eval_kwargs`)."""
    if held_out:
        return load_tasks(
            data.eval_source,
            kwargs=data.eval_kwargs,
            seed=data.seed,
            key="data.eval_source",
            env_factory=env_factory,
            split=data.eval_split,
        )[: data.eval_size]
    return load_tasks(
        data.source,
        kwargs=data.kwargs,
        seed=data.seed,
        env_factory=env_factory,
        split=data.split,
    )


def _call(
    what: str, fn: Callable[..., object], kwargs: Mapping[str, object] | None, seed: int
) -> Sequence[Task] | None:
    """`fn(**kwargs)`, with `seed` when it takes one; a TypeError names the arguments."""
    call_kwargs = dict(kwargs or {})
    if "seed" in inspect.signature(fn).parameters:
        call_kwargs.setdefault("seed", seed)
    try:
        result = fn(**call_kwargs)
    except TypeError as exc:
        raise ConfigError(f"{what} rejected its arguments {call_kwargs}: {exc}") from None
    return None if result is None else list(cast("Sequence[Task]", result))


def _checked(what: str, tasks: Sequence[Task] | None) -> list[Task]:
    if not tasks:
        raise ConfigError(f"{what} returned no tasks")
    bad = next((t for t in tasks if not isinstance(t, Task)), None)
    if bad is not None:
        raise ConfigError(f"{what} returned {type(bad).__name__}, not dora.Task")
    return list(tasks)


def _read_file(path: Path, *, key: str) -> list[Task]:
    if not path.is_file():
        raise ConfigError(f"{key}: no such file {path}")
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    import datasets

    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(
            FILE_SUFFIXES[path.suffix], data_files=str(path), split="train"
        )
    except Exception as exc:  # datasets raises many types; each names the bad row
        raise DataError(f"{path}: cannot read as {path.suffix[1:]}: {exc}") from exc
    tasks = []
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{path}, row {i}: expected an object, got {type(row).__name__}")
        prompt_id = str(row["id"]) if row.get("id") is not None else f"{path.stem}-{i}"
        tasks.append(Task(prompt_id, row))
    if not tasks:
        raise DataError(f"{path}: no rows")
    return tasks


def _read_jsonl(path: Path) -> list[Task]:
    """JSON lines, read here rather than through `datasets` so a bad row is named by number."""
    tasks = []
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}, row {i}: not valid JSON: {exc}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}, row {i}: expected a JSON object")
            tasks.append(Task(str(row.get("id", f"{path.stem}-{i}")), row))
    if not tasks:
        raise DataError(f"{path}: no rows")
    return tasks


# --- prompts that do not fit the context ----------------------------------------------------------


class PromptRenderer(Protocol):
    """How prompts become tokens (dora.render.ChatRenderer)."""

    def prompt_ids(self, prompt: Sequence[Message] | str, tools: Sequence[JSON]) -> list[int]: ...


@dataclass(frozen=True)
class Fitted:
    """The tasks that fit, and (prompt_id, prompt tokens) of each skipped one."""

    tasks: list[Task]
    skipped: list[tuple[str, int]]


async def fit_context(
    tasks: Sequence[Task],
    *,
    env_factory: Callable[[], Env],
    renderer: PromptRenderer,
    context_limit: int,
    key: str = "data.source",
    timeout_s: float = 30.0,
) -> Fitted:
    """Keep the tasks whose opening prompt leaves at least one token under `context_limit`.

    Each prompt is rendered as an episode renders it (`reset`, the tools' schemas, the chat
    template). Skipped rows are named in one warning; none fitting is a `DataError`. A `reset`
    that raises or takes longer than `timeout_s` is not judged here: the task is kept, and the
    episode's error policy handles it when it runs; but a source none of whose tasks gives a
    prompt (every `reset` failing, or text the tokenizer refuses in every row) is a `DataError`
    naming the source, at start. An agent's tasks (`dora.endpoint.AgentEnv`) are all kept: its
    prompts are made by its own loop. A prompt the model cannot render at all (chat
    messages for a tokenizer without a chat template) is a `ChatTemplateMissing` (a `ConfigError`),
    raised here, at start.
    """
    made = getattr(env_factory, "func", env_factory)
    if isinstance(made, type) and issubclass(made, AgentEnv):
        return Fitted(list(tasks), [])  # an agent's prompts are its own, made as it runs
    kept: list[Task] = []
    skipped: list[tuple[str, int]] = []
    failed: list[tuple[str, str]] = []
    threads = OffLoop(1, name="dora-env-fit")  # reset is user code: off the loop
    for task in tasks:
        length = await _prompt_length(env_factory, renderer, task, timeout_s, threads)
        if isinstance(length, str):
            failed.append((task.prompt_id, length))
        if isinstance(length, int) and length >= context_limit:
            skipped.append((task.prompt_id, length))
        else:
            kept.append(task)
    if tasks and len(failed) == len(tasks):
        named = "; ".join(f"{pid}: {why}" for pid, why in failed[:3])
        raise DataError(
            f"{key}: not one of its {len(tasks)} tasks gives a prompt the model can take "
            f"({named}{'; ...' if len(failed) > 3 else ''}): check the rows and the "
            "environment's reset()"
        )
    if skipped:
        named = ", ".join(f"{pid} ({n} tokens)" for pid, n in skipped[:20])
        more = f" and {len(skipped) - 20} more" if len(skipped) > 20 else ""
        message = (
            f"{key}: {len(skipped)} of {len(tasks)} prompts do not fit the context of "
            f"{context_limit} tokens (model.max_model_len): {named}{more}"
        )
        if not kept:
            raise DataError(f"{message}; no task is left to train on")
        log.warning("%s; skipped", message)
    return Fitted(kept, skipped)


async def _prompt_length(
    env_factory: Callable[[], Env],
    renderer: PromptRenderer,
    task: Task,
    timeout_s: float,
    threads: OffLoop,
) -> int | str:
    """The prompt's length in tokens, or why it could not be measured."""
    env = env_factory()
    try:
        prompt = cast(Prompt, await call_hook(threads, env.reset, task, timeout_s=timeout_s))
        schemas = [tool_schema(tool) for tool in env.tools()]
        return len(renderer.prompt_ids(prompt, schemas))
    except ChatTemplateMissing:
        raise  # the model cannot render this kind of prompt at all: stop at start
    except HookTimeout:
        # its thread may hang for good: it is never lent again, the next task gets another
        log.debug("prompt of %r not measured: reset timed out", task.prompt_id)
        return f"reset() took over {timeout_s:g} s"
    except Exception as exc:  # the episode's error policy owns a failing reset, not the loader
        log.debug("prompt of %r not measured: %r", task.prompt_id, exc)
        return f"{type(exc).__name__}: {exc}"[:200]
    finally:
        close = getattr(env, "close", None)  # an environment need not hold anything to release
        if close is not None:
            await call_hook(threads, close, timeout_s=timeout_s)
