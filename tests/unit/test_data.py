"""Tasks load from files and generator functions; bad input names the key, file and row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dora.data import load_tasks
from dora.env import Task
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
    from dora.config import load_config

    config = load_config(None, ["data.seed=3"])
    tasks = load_tasks(config.data.source, kwargs=config.data.kwargs, seed=config.data.seed)
    assert len(tasks) == 4096 and tasks[0].prompt_id.startswith("chain-3-")


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
    with pytest.raises(ConfigError, match="neither a dataset file"):
        load_tasks("just-a-name")
    with pytest.raises(ConfigError, match="rejected its arguments"):
        load_tasks("envs.math:chain_arithmetic_tasks", kwargs={"bogus": 1})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl"):
        load_tasks(str(bad))
    with pytest.raises(ConfigError, match=r"data\.eval_source"):
        load_tasks("", key="data.eval_source")
