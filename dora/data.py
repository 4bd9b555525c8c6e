"""Where a run's tasks come from: a dataset file, or a function that generates them.

`data.source` is either a file (`.jsonl`, `.json` or `.parquet`, read with `datasets`; each row
becomes a `Task` whose `prompt_id` is the row's `id` field or `<file stem>-<row number>`), or
`"module:function"`: a function returning tasks, called with `data.kwargs` and, when it accepts
one, `seed=data.seed` (e.g. `envs.math:chain_arithmetic_tasks` with `kwargs = {n = 2000}`).
The held-out set for evaluation comes the same way from `data.eval_source` and
`data.eval_kwargs`. A bad row is an error naming the file and the row.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path

from dora.env import Task, load_object
from dora.errors import ConfigError, DataError

FILE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_tasks(
    source: str,
    *,
    kwargs: Mapping[str, object] | None = None,
    seed: int = 0,
    key: str = "data.source",
) -> list[Task]:
    """The tasks `source` names; `key` is the config key quoted in errors."""
    if not source:
        raise ConfigError(
            f"{key} is empty: set it to a dataset file (.jsonl/.json/.parquet) or to "
            "'module:function' returning tasks, e.g. 'envs.math:chain_arithmetic_tasks'"
        )
    path = Path(source)
    if path.suffix in FILE_SUFFIXES:
        if kwargs:
            raise ConfigError(f"{key} is a file; its kwargs {dict(kwargs)} would be ignored")
        return _read_file(path, key=key)
    if ":" not in source:
        raise ConfigError(f"{key} = {source!r} is neither a dataset file nor 'module:function'")
    fn = load_object(source)
    if not callable(fn):
        raise ConfigError(f"{key} = {source!r} is not callable")
    call_kwargs = dict(kwargs or {})
    if "seed" in inspect.signature(fn).parameters:
        call_kwargs.setdefault("seed", seed)
    try:
        tasks = list(fn(**call_kwargs))
    except TypeError as exc:
        raise ConfigError(
            f"{key} = {source!r} rejected its arguments {call_kwargs}: {exc}"
        ) from None
    bad = next((t for t in tasks if not isinstance(t, Task)), None)
    if bad is not None:
        raise ConfigError(f"{key} = {source!r} returned {type(bad).__name__}, not dora.env.Task")
    if not tasks:
        raise ConfigError(f"{key} = {source!r} returned no tasks")
    return tasks


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
