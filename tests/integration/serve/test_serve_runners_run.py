"""`dora run` with its episodes on two runner processes: one that serve starts
(`serve.runners = 1`) and one attached with `dora runner --connect`, through a multi-turn tool
environment (`tool_turns_env.py`), while the trainer really trains a few steps. The run's
accounting must hold (every group trained once, staleness within K), every sample must be sampled
by its group's version alone (C1), the episodes must have their three turns, both runners must
have run episodes, and the held-out episodes of the evaluations must have run on them too."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dora.emulated.checks import check_accounting
from dora.net import free_port
from tests.commands import DORA, ROOT, checkout_env, held_out_evals, start_dora_run

pytestmark = pytest.mark.timeout(300)

EXAMPLE = ROOT / "examples" / "math" / "config.toml"
STEPS, B, G, K, TURNS = 4, 2, 2, 1, 3


def overrides(run_dir: Path) -> list[str]:
    return [
        f"learn.steps={STEPS}",
        f"learn.checkpoint_every={STEPS}",
        f"rollout.batch_size={B}",
        f"rollout.group_size={G}",
        f"rollout.staleness={K}",
        # The untrained tiny model samples near uniformly at this temperature: a turn ends
        # (`<|im_end|>`) within this budget most of the time, so most episodes reach their turns
        "rollout.temperature=3.0",
        "rollout.max_tokens=240",
        "rollout.max_turns=4",
        "serve.instances=1",
        "serve.runner_timeout_s=10",
        "model.warmup_steps=0",
        "model.max_model_len=1536",
        "env.cls=tests.integration.serve.tool_turns_env:ToolTurnsEnv",
        "data.kwargs.n=64",
        # the initial and the final version are evaluated, on the runners too
        "data.eval_kwargs={n = 2, seed = 1000, max_terms = 8}",
        "data.eval_size=2",
        f"data.eval_every={10 * STEPS}",
        "log.samples_every=1",
        "log.progress=false",
        f"log.run_dir={run_dir}",
    ]


def sampled_turns(mask: list[int]) -> int:
    """Stretches of tokens the model sampled (one per model turn)."""
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


def test_two_runners_one_started_by_serve_one_attached_run_a_tool_env(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = free_port("127.0.0.1")
    ov = overrides(run_dir)
    cache = str(tmp_path / "cache")
    run = start_dora_run(
        EXAMPLE,
        [*ov, "serve.runners=1", f"serve.runner_port={port}"],
        log=tmp_path / "dora-run.log",
        cwd=tmp_path,
        DORA_CACHE=cache,
    )
    runner: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "secret").exists():  # the runner's token is the run's secret
            assert run.poll() is None and time.monotonic() < deadline, "dora run did not start"
            time.sleep(0.1)
        attach = ["runner", "--connect", f"tcp://127.0.0.1:{port}", "--name", "attached"]
        with (tmp_path / "runner.log").open("wb") as out:
            runner = subprocess.Popen(
                [*DORA, *attach, str(EXAMPLE), *ov],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
                env=checkout_env(DORA_CACHE=cache),
            )
        code = run.wait(timeout=240)
    finally:
        for proc in (run, runner):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    log = (tmp_path / "dora-run.log").read_text(errors="replace")
    assert code == 0, log[-4000:]

    check = check_accounting(run_dir, steps=STEPS, batch_size=B, staleness=K)
    assert check.ok, check.problems
    extra = check.extra
    assert extra["runner_episodes_local-0"] > 0, extra
    assert extra["runner_episodes_attached"] > 0, (extra, (tmp_path / "runner.log").read_text())
    evals = held_out_evals(run_dir)
    assert [(e["version"], e["n"]) for e in evals] == [(0, 2), (STEPS, 2)], evals
    ran = extra["runner_episodes_local-0"] + extra["runner_episodes_attached"]
    assert ran >= STEPS * B * G + 4, "the held-out episodes ran on the runners too"
    assert extra["runners_refused"] == 0 and extra["runner_results_ignored"] == 0, extra

    groups = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(groups) >= STEPS * B
    turns = []
    for group in groups:
        for sample in group["samples"]:
            assert not sample["masked"], sample
            assert [v for _, _, v in sample["version_spans"]] == [group["version"]]  # C1
            turns.append(sampled_turns(sample["loss_mask"]))
    # every episode has a model turn; some have the environment's three (or more: a turn may
    # write a `<tool_call>` by chance, answered as a malformed call) within the token budget
    assert min(turns) >= 1 and max(turns) >= TURNS, turns
