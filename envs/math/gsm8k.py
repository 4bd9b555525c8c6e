"""GSM8K-format datasets: rows with a `question` and an `answer` whose last line is `#### <number>`.

Loaded through `datasets`: a local `.jsonl`/`.json` or `.parquet` file (or a folder of them), or a
hub name such as `openai/gsm8k` when the machine is online (dora never downloads at run time on its
own; asking for a hub name is the user's explicit choice). Every row becomes a `Task` whose
`prompt_id` is `<name>:<row>`, stable as long as the file is, with `data` = `question`, `answer`
(the worked solution) and `gold` (the text after `####`). A row without them is a `DataError` naming
the file and the row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from dora import DataError, Task
from envs.math.answers import extract_hash_answer

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _load_rows(
    source: str, *, split: str, config: str | None, cache_dir: str | None
) -> Iterable[Mapping[str, object]]:
    import datasets

    path = Path(source)
    if path.exists():
        files = (
            sorted(p for p in path.iterdir() if p.suffix in _FORMATS) if path.is_dir() else [path]
        )
        kinds = {_FORMATS.get(p.suffix) for p in files}
        if not files or None in kinds or len(kinds) != 1:
            raise DataError(
                f"{source}: expected .jsonl, .json or .parquet file(s) of one kind, found "
                f"{[p.name for p in files] or 'none'}"
            )
        return datasets.load_dataset(
            kinds.pop(), data_files=[str(p) for p in files], split="train", cache_dir=cache_dir
        )
    try:
        return datasets.load_dataset(source, config, split=split, cache_dir=cache_dir)
    except Exception as exc:  # datasets raises many types (connection, missing files, ...)
        raise DataError(
            f"{source!r} is not a local file and loading it from the hub failed "
            f"({type(exc).__name__}: {exc}); pass a path to a .jsonl or .parquet file"
        ) from exc


def load_gsm8k(
    source: str,
    *,
    split: str = "train",
    config: str | None = "main",
    limit: int | None = None,
    name: str | None = None,
    cache_dir: str | None = None,
) -> list[Task]:
    """Tasks from a GSM8K-format file, folder or hub dataset (`split`/`config` apply to the hub).

    `name` prefixes the prompt ids (default: the file's stem, or the hub name and split).
    """
    rows = _load_rows(source, split=split, config=config, cache_dir=cache_dir)
    prefix = name or (Path(source).stem if Path(source).exists() else f"{source}/{split}")
    tasks = []
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise DataError(
                f"{source}, row {i}: needs string fields 'question' and 'answer', got {sorted(row)}"
            )
        gold = extract_hash_answer(answer)
        if gold is None:
            raise DataError(f"{source}, row {i}: answer has no '#### <answer>' line: {answer!r}")
        tasks.append(Task(f"{prefix}:{i}", {"question": question, "answer": answer, "gold": gold}))
    return tasks
