"""The engine's two stepping threads: the model moves to the SCHED_IDLE thread and back, answers
do not change when it moves mid-answer, and no privilege is needed for either direction."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dora.engine.batcher import Batcher, BatcherConfig
from dora.engine.worker import EngineWorker
from dora.models.tiny import build_tiny_model
from dora.protocol import SamplingParams

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("turns") / "tiny")


def _batcher(model_dir: Path) -> Batcher:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    return Batcher(model, eos_token_ids=[], decode=tok.decode, config=BatcherConfig(max_running=8))


@pytest.fixture
def worker(model_dir: Path) -> Iterator[EngineWorker]:
    w = EngineWorker(_batcher(model_dir), threads=1)
    w.start()
    try:
        yield w
    finally:
        w.stop()


def _stepping(worker: EngineWorker) -> tuple[str, int]:
    """The thread that runs the worker's next command, and its scheduling policy."""
    return worker.call(
        lambda _: (threading.current_thread().name, os.sched_getscheduler(0))
    ).result(timeout=10)


def test_the_model_moves_to_the_idle_thread_and_back(worker: EngineWorker) -> None:
    assert _stepping(worker) == ("dora-engine", os.SCHED_OTHER)
    worker.set_background(True)
    assert _stepping(worker) == ("dora-engine-idle", os.SCHED_IDLE)
    worker.set_background(True)  # the same role again: nothing moves
    assert _stepping(worker) == ("dora-engine-idle", os.SCHED_IDLE)
    worker.set_background(False)
    assert _stepping(worker) == ("dora-engine", os.SCHED_OTHER)


def test_stopping_in_the_background_ends_both_threads(model_dir: Path) -> None:
    w = EngineWorker(_batcher(model_dir), threads=1)
    w.start()
    w.set_background(True)
    assert _stepping(w)[0] == "dora-engine-idle"
    w.stop()
    assert not any(t.name.startswith("dora-engine") for t in threading.enumerate())


def _answers(worker: EngineWorker, *, flip_every_s: float | None) -> list[list[int]]:
    """Eight seeded answers of 60 tokens; the role flips every `flip_every_s` meanwhile."""
    b = worker.batcher
    seqs = [
        b.new_sequence(
            f"r{i}",
            list(range(3, 9 + i)),
            SamplingParams(max_tokens=60, temperature=1.0, seed=i, ignore_eos=True),
        )
        for i in range(8)
    ]
    # all in one command: both runs step the same batches
    worker.call(lambda batcher: [batcher.add(seq) for seq in seqs]).result(timeout=10)
    flips = 0
    while any(seq.finish_reason is None for seq in seqs):
        if flip_every_s is not None:
            worker.set_background(not worker.background)
            flips += 1
        time.sleep(flip_every_s or 0.005)
    worker.set_background(False)
    if flip_every_s is not None:
        assert flips >= 4  # the model really moved while it answered
    return [list(seq.token_ids) for seq in seqs]


def test_answers_are_the_same_when_the_model_moves_mid_answer(worker: EngineWorker) -> None:
    still = _answers(worker, flip_every_s=None)
    moved = _answers(worker, flip_every_s=0.002)
    assert moved == still and all(len(a) == 60 for a in still)


DROPPED = """
import os, resource, sys, threading
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from dora.engine.batcher import Batcher, BatcherConfig
from dora.engine.worker import EngineWorker
from dora.protocol import SamplingParams

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(sys.argv[1])
w = EngineWorker(Batcher(model, eos_token_ids=[], decode=tok.decode, config=BatcherConfig()))
w.start()
seq = w.batcher.new_sequence("r", [3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True, seed=0))
w.call(lambda b: b.add(seq)).result()  # first step: every library the step needs is loaded
while seq.finish_reason is None:
    pass
resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)  # no root, no capability, no nice allowance from here on

def stepping():
    return w.call(lambda _: (threading.current_thread().name, os.sched_getscheduler(0))).result()

roles = []
for background in (True, False, True, False):
    w.set_background(background)
    roles.append(stepping())
lifted = []
def lift():
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        lifted.append(True)
    except PermissionError:
        lifted.append(False)
t = threading.Thread(target=lift)
t.start()
t.join()
w.stop()
print(roles, lifted)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to an unprivileged user")
def test_an_unprivileged_engine_moves_both_ways(model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", DROPPED, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    idle, normal = ("dora-engine-idle", os.SCHED_IDLE), ("dora-engine", os.SCHED_OTHER)
    # the process may not lift a thread from SCHED_IDLE itself, yet the model went back and forth
    expected = f"{[idle, normal, idle, normal]} [False]"
    assert done.stdout.strip().splitlines()[-1] == expected, done.stdout
