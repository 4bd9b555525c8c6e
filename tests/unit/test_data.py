"""Tasks load from the environment, files and generator functions; bad input names the key, file
and row."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest

from dora.data import config_tasks, load_tasks
from dora.env import Message, SingleTurnEnv, Task, load_env
from dora.errors import ConfigError, DataError


def test_generator_gets_kwargs_and_seed() -> None:
    a = load_tasks("envs.math:chain_arithmetic_tasks", kwargs={"n": 5, "max_terms": 4}, seed=3)
    b = load_tasks("envs.math:chain_arithmetic_tasks", kwargs={"n": 5, "max_terms": 4}, seed=3)
    c = load_tasks("envs.math:chain_arithmetic_tasks", kwargs={"n": 5, "max_terms": 4}, seed=4)
    assert len(a) == 5 and all(isinstance(t, Task) for t in a)
    assert a == b and a != c
    assert all(int(t["num_terms"]) <= 4 for t in a)


def test_jsonl_rows_become_tasks(tmp_path: Path) -> None:
    path = tmp_path / "gsm.jsonl"
    rows = [
        {"question": "1+1?", "answer": "#### 2"},
        {"id": "q7", "question": "2+2?", "answer": "#### 4"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tasks = load_tasks(str(path))
    assert [t.prompt_id for t in tasks] == ["gsm-1", "q7"]
    assert tasks[1]["question"] == "2+2?"


def test_jsonl_bad_rows_name_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(
        '{"id": "a", "question": "1+1", "gold": "2"}\n\n{"question": "2+2"}\nnot json\n'
    )
    with pytest.raises(DataError, match=r"rows\.jsonl, row 4: not valid JSON"):
        load_tasks(str(path))
    path.write_text('{"id": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"rows\.jsonl, row 2: expected a JSON object"):
        load_tasks(str(path))


def test_the_default_config_names_a_working_source() -> None:
    """`data.source = "env"`: the default environment brings its own tasks, the same chains the
    generator gives, and a held-out split of other chains."""
    from dora.config import load_config

    config = load_config(None, ["data.seed=3", "data.kwargs={n = 50}", "data.eval_source=env"])
    factory = load_env(config.env.cls, **config.env.kwargs)
    tasks = config_tasks(config.data, factory)
    assert tasks == load_tasks("envs.math:chain_arithmetic_tasks", kwargs={"n": 50}, seed=3)
    held_out = config_tasks(config.data, factory, held_out=True)
    assert len(held_out) == config.data.eval_size
    assert not {t.prompt_id for t in tasks} & {t.prompt_id for t in held_out}
    assert {t["question"] for t in tasks} != {t["question"] for t in held_out}


class _OwnTasksEnv(SingleTurnEnv):
    """Brings tasks of its own; `size` is an env setting, `repeat` a task argument."""

    def __init__(self, *, size: int = 2) -> None:
        self.size = size

    def tasks(self, split: str, *, repeat: int = 1) -> list[Task] | None:
        if split == "none":
            return None
        rows = range(self.size * repeat)
        return [Task(f"{split}-{i}", {"question": f"{i}?"}) for i in rows]


def test_env_source_reads_the_environment_tasks_with_its_settings_and_kwargs() -> None:
    def factory() -> _OwnTasksEnv:
        return _OwnTasksEnv(size=3)

    tasks = load_tasks("env", env_factory=factory, split="dev", kwargs={"repeat": 2})
    assert [t.prompt_id for t in tasks] == [f"dev-{i}" for i in range(6)]
    with pytest.raises(ConfigError, match="rejected its arguments"):
        load_tasks("env", env_factory=factory, kwargs={"bogus": 1})
    with pytest.raises(ConfigError, match="_OwnTasksEnv has no tasks of its own"):
        load_tasks("env", env_factory=factory, split="none")
    with pytest.raises(ConfigError, match="returned no tasks"):
        load_tasks("env", env_factory=lambda: _OwnTasksEnv(size=0))
    with pytest.raises(ConfigError, match="has no tasks of its own"):
        load_tasks("env", env_factory=SingleTurnEnv)  # the default Env.tasks has none


def test_parquet_rows_become_tasks(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["a", "b"], "answer": ["#### 1", "#### 2"]}), path)
    assert [t["answer"] for t in load_tasks(str(path))] == ["#### 1", "#### 2"]


def test_errors_name_the_key_file_and_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.source is empty"):
        load_tasks("")
    with pytest.raises(ConfigError, match="no such file"):
        load_tasks(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="neither 'env', a dataset file"):
        load_tasks("just-a-name")
    with pytest.raises(ConfigError, match="rejected its arguments"):
        load_tasks("envs.math:chain_arithmetic_tasks", kwargs={"bogus": 1})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl"):
        load_tasks(str(bad))
    with pytest.raises(ConfigError, match=r"data\.eval_source"):
        load_tasks("", key="data.eval_source")


# -- prompts longer than the context -----------------------------------------------------------


class _LongEnv(SingleTurnEnv):
    """A question per row; rows with `"tools": true` also offer a tool (its schema is prompt)."""

    def __init__(self) -> None:
        self.with_tools = False

    def reset(self, task: Task) -> list[Message] | str:
        if task.data.get("broken"):
            raise KeyError("no question")
        self.with_tools = bool(task.data.get("tools"))
        return super().reset(task) if task.data.get("chat", True) else str(task["question"])

    def tools(self) -> list[Callable[..., object]]:
        return [self.lookup] if self.with_tools else []

    def lookup(self, word: str) -> str:
        """Look a word up in a dictionary with a long description that costs prompt tokens.

        Args:
            word: the word to look up, spelled exactly as it appears in the question.
        """
        return word

    def score(self, answer: str, task: Task) -> float:
        return 0.0


@pytest.fixture(scope="module")
def renderer() -> object:
    from dora.episode import ChatRenderer
    from dora.models.tiny import char_tokenizer

    return ChatRenderer(char_tokenizer())  # type: ignore[arg-type]


async def test_rows_whose_prompt_does_not_fit_are_skipped_and_named(
    tmp_path: Path, renderer: object, caplog: pytest.LogCaptureFixture
) -> None:
    from dora.data import fit_context

    rows = [
        {"question": "1+1?"},
        {"question": "x" * 400},
        {"question": "2+2?", "tools": True},  # short text, but the tool schema makes it long
        {"question": "y" * 400, "chat": False},
        {"question": "3+3?", "chat": False},
        {"broken": True},  # reset raises: kept, for the episode's error policy
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tasks = load_tasks(str(path))
    with caplog.at_level("WARNING", logger="dora.data"):
        fitted = await fit_context(
            tasks,
            env_factory=_LongEnv,
            renderer=renderer,
            context_limit=200,  # type: ignore[arg-type]
        )
    assert [t.prompt_id for t in fitted.tasks] == ["rows-1", "rows-5", "rows-6"]
    assert [pid for pid, _ in fitted.skipped] == ["rows-2", "rows-3", "rows-4"]
    assert all(n >= 200 for _, n in fitted.skipped)
    assert fitted.skipped[2][1] == 400  # plain text: exactly its characters
    (warning,) = caplog.records
    assert "3 of 6 prompts do not fit the context of 200 tokens" in warning.getMessage()
    assert "rows-2 (" in warning.getMessage() and "rows-4 (400 tokens)" in warning.getMessage()


async def test_no_prompt_fitting_is_an_error_naming_the_rows(renderer: object) -> None:
    from dora.data import fit_context

    tasks = [Task("long-a", {"question": "z" * 300}), Task("long-b", {"question": "w" * 300})]
    with pytest.raises(DataError, match=r"data\.eval_source: 2 of 2 .* long-a .* no task is left"):
        await fit_context(
            tasks,
            env_factory=_LongEnv,
            renderer=renderer,  # type: ignore[arg-type]
            context_limit=100,
            key="data.eval_source",
        )


class _StuckEnv(_LongEnv):
    """A synchronous reset that hangs on one task (a loader waiting on a dead share)."""

    threads: ClassVar[list[str]] = []

    def reset(self, task: Task) -> object:  # type: ignore[override]
        _StuckEnv.threads.append(threading.current_thread().name)
        if task.prompt_id == "stuck":
            time.sleep(3.0)
        return super().reset(task)


async def test_a_sync_reset_that_hangs_is_measured_off_the_loop_and_cut(renderer: object) -> None:
    from dora.data import fit_context

    tasks = [Task(pid, {"question": "1+1?"}) for pid in ("a", "stuck", "b")]
    loop = asyncio.get_running_loop()
    began = loop.time()
    fitted = await fit_context(
        tasks,
        env_factory=_StuckEnv,
        renderer=renderer,  # type: ignore[arg-type]
        context_limit=200,
        timeout_s=0.3,
    )
    assert loop.time() - began < 2.5, "the hung reset is cut, and the next task has a thread"
    assert [t.prompt_id for t in fitted.tasks] == ["a", "stuck", "b"]  # kept for the episode
    assert _StuckEnv.threads and all(n.startswith("dora-env-fit") for n in _StuckEnv.threads)


async def test_a_source_whose_every_row_is_unusable_stops_at_start_naming_it(
    renderer: object,
) -> None:
    from dora.data import fit_context

    broken = [Task(f"b{i}", {"broken": True}) for i in range(3)]
    surrogate = [Task(f"s{i}", {"question": "\ud83d?", "chat": False}) for i in range(3)]
    for tasks, why in ((broken, "b0: "), (surrogate, "s0: ")):
        with pytest.raises(DataError, match=rf"data\.source: not one of its 3 tasks .*{why}"):
            await fit_context(
                tasks,
                env_factory=_LongEnv,
                renderer=renderer,  # type: ignore[arg-type]
                context_limit=200,
            )
    # one usable row is enough: the others are left to the episode's error policy
    fitted = await fit_context(
        [*broken, Task("ok", {"question": "1+1?"})],
        env_factory=_LongEnv,
        renderer=renderer,  # type: ignore[arg-type]
        context_limit=200,
    )
    assert len(fitted.tasks) == 4
