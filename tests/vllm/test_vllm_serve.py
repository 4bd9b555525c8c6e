"""`dora serve` with `serve.backend = "vllm"`: the serve issue's scenario (dora mode, fewer steps)
on two real vLLM instances of the tiny model, with the toy trainer over the real ZMQ protocol.

Checked: every group arrives exactly once and every step gets exactly B groups; `0 <= t - w <= K`;
every sampled token came from its group's version (the versions the vLLM client reported, which
it tracks across loads); the instances loaded the trainer's versions (inline weights over
`collective_rpc`); utilisation is reported per instance; moves are resubmissions (no KV export).
dora serve starts the two servers itself (`serve.backend = "vllm"`, `serve.instances = 2`) and
stops them at the end; attaching by URL is tested in test_vllm_backend.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import needs_vllm

from dora.config import load_config
from dora.errors import ConfigError
from dora.serve.main import run_serve

sys.path.insert(0, str(Path(__file__).parents[1] / "integration" / "serve"))
from serve_helpers import on_free_port
from serve_trainer import ToyTrainer

pytestmark = [*needs_vllm, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

STEPS, B, G, K = 6, 2, 4, 2


async def test_dora_serve_on_vllm(tiny_model: Path, tmp_path: Path, own_tmpdir: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "question": f"{i} + {i + 1}", "gold": str(2 * i + 1)}) + "\n"
            for i in range(100)
        )
    )
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={json.dumps(str(tiny_model))}",
        "model.max_model_len=512",
        "serve.backend=vllm",
        "serve.instances=2",
        "serve.max_running=8",
        "serve.request_timeout_s=120",
        "serve.weight_load_timeout_s=60",
        "serve.kv_migration=false",
        "rollout.mode=dora",
        f"rollout.staleness={K}",
        f"rollout.group_size={G}",
        f"rollout.batch_size={B}",
        "rollout.max_tokens=128",
        "rollout.max_turns=1",
        f"learn.steps={STEPS}",
        "env.cls=envs.math:ChainArithmeticEnv",
        f"data.source={json.dumps(str(tasks))}",
        "data.kwargs={}",
        f"log.run_dir={json.dumps(str(run_dir))}",
        "log.metrics_every_s=0.25",
        "log.progress=false",
    ]
    config = load_config(None, overrides)
    config, address = on_free_port(config)
    # The trainer waits for its first group while dora serve starts the vLLM servers (25-60 s).
    trainer = ToyTrainer(address, model_dir=tiny_model, steps=STEPS, batch_size=B, timeout_s=240)
    trainer.start()
    try:
        report: Any = await asyncio.wait_for(
            run_serve(config, run_dir=run_dir, progress=False), 240
        )
    except ConfigError as exc:
        if "not available in dora serve yet" not in str(exc):
            raise
        pytest.skip(f"dora serve has no vLLM hook yet (dora.vllm.launcher.vllm_instances): {exc}")
    await asyncio.to_thread(trainer.join)
    # the RolloutReport (read by attribute: its module is still moving)
    print(f"\n{report}")

    ids = [g.id for _, g in trainer.received]
    assert len(ids) == STEPS * B and len(set(ids)) == len(ids), "every group exactly once"
    assert sorted(trainer.by_step) == list(range(STEPS))
    assert all(len(gs) == B for gs in trainer.by_step.values())
    assert trainer.trained == list(range(STEPS)) and trainer.shutdown
    for step, group in trainer.received:
        assert 0 <= step - group.version <= K, (group.id, step, group.version)
        assert len(group.samples) == G
        for sample in group.samples:
            versions = sample.token_versions()[sample.mask() == 1]
            assert len(versions) > 0 and (versions == group.version).all(), group.id
    assert report.weight_loads > 0 and report.failed_calls == 0 and report.kv_migrations == 0
    assert {g.version for _, g in trainer.received} != {0}, "later versions sampled too"
    # Moves depend on timing on a shared machine; when they happen they are resubmissions.
    assert report.resubmissions <= report.migrations
    assert set(report.utilisation) == {"i0", "i1"}
    logs = sorted(p.name for p in (run_dir / "vllm").iterdir())
    assert logs == ["vllm-i0.log", "vllm-i1.log"], logs
    # vLLM's IPC socket files went to each server's scratch folder, removed when it stopped
    assert os.listdir(own_tmpdir) == []
