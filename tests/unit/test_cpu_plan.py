"""`dora run`'s threads on one CPU machine: every mode gets every core, unpinned."""

from __future__ import annotations

import os
from pathlib import Path

from dora.config import load_config
from dora.config_file import raw_config
from dora.cpu_plan import given_keys, run_threads


def test_sync_trains_on_every_core_and_the_others_share_them() -> None:
    assert run_threads("sync", 2, instances=2, given=set()) == [
        "serve.threads_per_instance=1",
        "learn.threads=2",
    ]
    for mode in ("one_step_off", "partial", "dora"):
        assert run_threads(mode, 2, instances=2, given=set()) == [
            "serve.threads_per_instance=1",
            "learn.threads=1",
        ]
    assert run_threads("dora", 16, instances=4, given=set()) == [
        "serve.threads_per_instance=3",
        "learn.threads=4",
    ]


def test_what_the_user_set_is_left_alone() -> None:
    raw = {"learn": {"threads": 3, "lr": 1e-5}, "serve": {"instances": 2}, "name": "x"}
    given = given_keys(raw, ["serve.threads_per_instance=2", "rollout.mode=sync"])
    assert given == {
        "learn.threads",
        "learn.lr",
        "serve.instances",
        "serve.threads_per_instance",
        "rollout.mode",
    }
    assert run_threads("sync", 2, instances=2, given=given) == []
    assert run_threads("sync", 2, instances=2, given={"learn.threads"}) == [
        "serve.threads_per_instance=1"
    ]


def test_dora_run_reads_what_the_config_file_and_the_command_line_set(tmp_path: Path) -> None:
    from dora.launch import thread_overrides

    path = tmp_path / "c.toml"
    path.write_text('[rollout]\nmode = "sync"\n[learn]\nthreads = 3\n')
    config = load_config(path, [])
    cores = len(os.sched_getaffinity(0))
    assert thread_overrides(raw_config(path), [], config) == [
        f"serve.threads_per_instance={max(1, cores // config.serve.instances)}"
    ]
    given = ["serve.threads_per_instance=2"]
    assert thread_overrides(raw_config(path, given), given, config) == []
