"""An engine paused by someone other than serve (a caller holding the engines' token) stalls its
calls until `serve.request_timeout_s`, unless serve notices: its `/health` then answers 503, so
serve declares it unresponsive within `serve.health_timeout_s`, moves its calls to the other
instance, and the run finishes."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import pytest
from serve_helpers import engines_in_process, on_free_port
from serve_trainer import ToyTrainer

from dora.config import ServeConfig, load_config
from dora.serve.main import run_serve

pytestmark = pytest.mark.timeout(180)

TOKEN = "s3cret-token"
STEPS, B, HEALTH_S = 4, 2, 5.0


async def test_control_auth_pause_noticed_within_health_deadline(
    tmp_path: Path, long_tail_model: Path
) -> None:
    run_dir = tmp_path / "run"
    config = load_config(
        None,
        [
            f"model.path={json.dumps(str(long_tail_model))}",
            "model.max_model_len=128",
            f"serve.token={TOKEN}",
            "serve.instances=2",
            "serve.max_running=8",
            "serve.request_timeout_s=120",
            f"serve.health_timeout_s={HEALTH_S}",
            "rollout.group_size=2",
            f"rollout.batch_size={B}",
            "rollout.max_tokens=32",
            "rollout.max_turns=1",
            f"learn.steps={STEPS}",
            f"log.run_dir={json.dumps(str(run_dir))}",
            "log.metrics_every_s=0.25",
            "log.progress=false",
        ],
    )
    config, address = on_free_port(config)
    noticed_after: list[float] = []
    log = run_dir / "rollout.jsonl"

    async with engines_in_process(config) as attached:
        victim = attached.serve.urls[0]

        def pause_one(step: int) -> None:
            if step != 1:
                return
            request = urllib.request.Request(f"{victim}/control/pause", data=b"{}", method="POST")
            request.add_header("Authorization", f"Bearer {TOKEN}")
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
            paused_at = time.monotonic()
            while b"instance_unresponsive" not in log.read_bytes():
                if time.monotonic() - paused_at > 60:
                    return  # never noticed: the assertion below says so
                time.sleep(0.05)
            noticed_after.append(time.monotonic() - paused_at)

        trainer = ToyTrainer(
            address,
            model_dir=long_tail_model,
            steps=STEPS,
            batch_size=B,
            timeout_s=120,
            on_trained=pause_one,
            link_config=ServeConfig(token=TOKEN),
        )
        trainer.start()
        await asyncio.wait_for(run_serve(attached, run_dir=run_dir, progress=False), 150)
        await asyncio.to_thread(trainer.join)

    assert noticed_after, "the paused engine was never declared unresponsive"
    assert noticed_after[0] <= HEALTH_S, noticed_after
    records = [json.loads(x) for x in log.read_text().splitlines()]
    hung = [r for r in records if r["kind"] == "instance_unresponsive"]
    assert len(hung) == 1 and hung[0]["instance"] == "i0" and "paused" in hung[0]["error"], hung
    assert trainer.trained == list(range(STEPS)) and trainer.shutdown
    assert len(trainer.received) == STEPS * B
