"""Chaos with the sharded trainer: `dora run` on the math example, made small, with `dora learn`
on two gloo ranks under `learn.strategy = "fsdp"`, killed (SIGKILL, the `dora learn` process
alone) two steps past a checkpoint, at a random moment drawn from a seed.

`dora run` resumes the trainer from its sharded checkpoint (every rank reloads its share of the
optimizer state) and serve rolls back the versions the lost trainer published since. The checks
of `test_chaos.py` hold: admitted = consumed + filtered + rolled back (nothing left unassigned);
every step trained on exactly B groups by two ranks, no group in two steps, staleness at most K;
the roll-back seen; the final checkpoint loads with transformers and holds the optimizer's
shards; no process (the killed trainer's ranks included) is left behind.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from test_chaos import (
    EXAMPLE,
    _count,
    _kill,
    _last_step,
    _records,
    _remember,
    _step_time,
    _stop,
    check_accounting,
    check_final_checkpoint,
    check_nothing_left,
)

from dora.config import load_config
from tests.commands import start_dora_run

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

STEPS, B, G, K, EVERY = 8, 2, 4, 2, 3
SEED = 7


@pytest.mark.two_ranks
def test_chaos_with_the_fsdp_trainer(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    run_dir = tmp_path / "run"
    overrides = [
        f"learn.steps={STEPS}",
        f"learn.checkpoint_every={EVERY}",
        "learn.recv_timeout_s=90",
        "learn.processes=2",
        "learn.strategy=fsdp",
        f"rollout.batch_size={B}",
        f"rollout.group_size={G}",
        f"rollout.staleness={K}",
        "rollout.max_tokens=48",
        "serve.instances=1",
        "serve.max_running=16",
        "serve.request_timeout_s=90",
        "serve.weight_load_timeout_s=60",
        "model.warmup_steps=10",
        "data.eval_source=",
        "log.progress=false",
        "log.metrics_every_s=0.5",
        f"log.run_dir={run_dir}",
    ]
    load_config(EXAMPLE, overrides)  # a bad override fails here, not as a hung run
    run = start_dora_run(EXAMPLE, overrides, log=tmp_path / "dora-run.log", cwd=tmp_path)
    seen: set[int] = {run.pid}
    killed = None
    try:
        deadline = time.monotonic() + 240
        # two steps past a checkpoint (step 2 is durable, steps 3 and 4 are not), so the versions
        # the trainer published since are ghosts whose groups the roll-back removes
        while run.poll() is None and _last_step(run_dir) < EVERY + 1:
            assert time.monotonic() < deadline, "no progress to the fault"
            _remember(run.pid, seen)
            time.sleep(0.05)
        # a random moment inside step 5, well before it can be trained and checkpointed
        time.sleep(rng.uniform(0.0, 0.25 * _step_time(run_dir)))
        _remember(run.pid, seen)
        killed = _kill(run.pid, "learn")
        assert killed is not None, "the trainer was running"
        while run.poll() is None and time.monotonic() < deadline:
            _remember(run.pid, seen)
            time.sleep(0.2)
        code = run.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _stop(run)
    log = (tmp_path / "dora-run.log").read_text(errors="replace")
    assert code == 0, log[-4000:]
    learn_log = (run_dir / "learn.log").read_text(errors="replace")

    # --- the run's accounting, from the run directory -------------------------------------------
    check_accounting(run_dir, steps=STEPS, batch_size=B, staleness=K)
    lines = _records(run_dir / "learn-metrics.jsonl")
    assert len(lines) >= STEPS + 2, "steps 3 and 4, past the checkpoint, trained again"
    assert all(r["ranks"] == 2 for r in lines)

    restarts = [r for r in _records(run_dir / "supervisor.jsonl") if r["kind"] == "exit"]
    assert [r["component"] for r in restarts] == ["learn"], restarts
    assert _count(run_dir, "rollback") >= 1, learn_log[-2000:]

    latest = check_final_checkpoint(run_dir, steps=STEPS)
    assert json.loads((latest / "trainer.json").read_text())["incarnation"] == 1
    assert (latest / "optimizer" / ".metadata").is_file()  # the shards of every rank
    check_nothing_left(seen)
