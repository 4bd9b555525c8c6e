"""The run of docs/trainer.md's "Across machines", on one machine: `dora serve` and a two-rank
`dora learn` (FSDP over gloo) each from its own config and its own run directory, as on two nodes,
over the trainer link encrypted with CURVE (each side holding its own secret key and the other's
public key) and the hello token. The run goes to the end: every step filled and trained by both
ranks, and the trainer's last checkpoint holds the sharded optimizer state.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import zmq.auth
from serve_helpers import serve_in_process

from dora.config import load_config
from dora.launch import free_port

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TOKEN = "s3cret-token"
STEPS, B = 3, 2


def _shared(model: Path) -> list[str]:
    """The settings both nodes agree on (the same model, run length and batch shape)."""
    return [
        f"model.path={json.dumps(str(model))}",
        "model.max_model_len=128",
        "rollout.group_size=2",
        f"rollout.batch_size={B}",
        "rollout.max_tokens=16",
        "rollout.max_turns=1",
        f"learn.steps={STEPS}",
        f"serve.token={TOKEN}",
        "log.progress=false",
    ]


@pytest.mark.two_ranks
async def test_two_rank_trainer_over_the_curve_link(tmp_path: Path, long_tail_model: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(keys, "server")
    client_public, client_secret = zmq.auth.create_certificates(keys, "client")
    port = free_port("127.0.0.1")
    serve_config = load_config(
        None,
        [
            *_shared(long_tail_model),
            f"serve.port={port}",
            f"serve.link_server_key={json.dumps(str(server_secret))}",
            f"serve.link_client_key={json.dumps(str(client_public))}",
            "serve.instances=1",
            "serve.max_running=8",
            "serve.request_timeout_s=60",
            f"log.run_dir={json.dumps(str(tmp_path / 'serve-run'))}",
        ],
    )
    learn_run = tmp_path / "learn-run"
    learn_args = [
        *_shared(long_tail_model),
        "serve.host=127.0.0.1",
        f"serve.port={port}",
        f"serve.link_server_key={json.dumps(str(server_public))}",
        f"serve.link_client_key={json.dumps(str(client_secret))}",
        "learn.processes=2",
        "learn.strategy=fsdp",
        "learn.recv_timeout_s=120",
        f"log.run_dir={json.dumps(str(learn_run))}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "DORA_SERVE_ADDRESS"}
    learn_config = tmp_path / "learn.toml"  # the trainer node's file; its settings given below
    learn_config.write_text("")
    trainer = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "dora.cli", "learn", str(learn_config), *learn_args],
        env=env,
        start_new_session=True,
    )
    try:
        await asyncio.wait_for(serve_in_process(serve_config, run_dir=tmp_path / "serve-run"), 240)
        assert await asyncio.wait_for(trainer.wait(), 60) == 0
    finally:
        if trainer.returncode is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            await trainer.wait()

    summary = json.loads((tmp_path / "serve-run" / "summary.json").read_text())
    assert summary["extra"]["consumed"] == STEPS * B, summary["extra"]
    metrics = [json.loads(x) for x in (learn_run / "learn-metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(m["ranks"] == 2 and m["groups"] == B for m in metrics)
    latest = (learn_run / "checkpoints" / "latest").read_text().strip()
    checkpoint = learn_run / "checkpoints" / latest
    assert json.loads((checkpoint / "trainer.json").read_text())["step"] == STEPS - 1
    assert (checkpoint / "optimizer" / ".metadata").is_file()  # every rank's share, by DCP
