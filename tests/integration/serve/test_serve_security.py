"""`dora serve` with the security settings of docs/reliability.md taken from its config, and a
dataset with a prompt that cannot fit.

- With `serve.host` off loopback, the trainer link is built from `serve.*`: the trainer reaches it
  only with the CURVE keys and the token of its own config, and the run goes to the end.
- The engines serve starts itself bind 127.0.0.1 whatever `serve.host` says, and with
  `serve.token` their control endpoints refuse a caller without it, loopback or not; serve's own
  clients send it (as processes, the engine reads it from `DORA_ENGINE_TOKEN`).
- A row whose prompt does not fit `model.max_model_len` is never sampled, and `summary.json`
  counts it as `extra.prompts_skipped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import aiohttp
import pytest
import zmq.auth
from serve_helpers import serve_in_process
from serve_trainer import ToyTrainer

from dora.config import DoraConfig, ServeConfig, load_config
from dora.launch import free_port
from dora.serve.instances import InstanceSpec, start_in_process
from dora.serve.main import _instances

pytestmark = pytest.mark.timeout(120)

TOKEN = "s3cret-token"
STEPS, B = 3, 2


def _config(tmp_path: Path, model: Path, *overrides: str) -> DoraConfig:
    return load_config(
        None,
        [
            f"model.path={json.dumps(str(model))}",
            "model.max_model_len=128",
            "serve.host=0.0.0.0",
            f"serve.token={TOKEN}",
            "serve.instances=1",
            "serve.max_running=8",
            "serve.request_timeout_s=60",
            "rollout.group_size=2",
            f"rollout.batch_size={B}",
            "rollout.max_tokens=16",
            "rollout.max_turns=1",
            f"learn.steps={STEPS}",
            f"log.run_dir={json.dumps(str(tmp_path / 'run'))}",
            "log.metrics_every_s=0.25",
            "log.progress=false",
            *overrides,
        ],
    )


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "process"])
async def test_engines_bind_loopback_and_need_the_token(
    tmp_path: Path, long_tail_model: Path, in_process: bool
) -> None:
    config = _config(tmp_path, long_tail_model)
    async with contextlib.AsyncExitStack() as stack:
        if in_process:  # as the serve tests start them (then attached through `serve.urls`)
            spec = InstanceSpec.from_config(config, long_tail_model)
            handles = await stack.enter_async_context(start_in_process(spec, 1))
        else:
            instances = _instances(config, long_tail_model, run_dir=tmp_path, plan=None)
            handles, _ = await stack.enter_async_context(instances)
        (handle,) = handles
        assert handle.url.startswith("http://127.0.0.1:"), handle.url
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{handle.url}/control/pause") as response,
        ):
            assert response.status == 401, "control from loopback without the token"
        loaded = await handle.client.load_weights(0, path=str(long_tail_model), timeout_s=60)
        assert loaded, "serve's own client sends the token"


def _write_tasks(path: Path) -> None:
    rows = [
        {"id": f"short-{i}", "question": f"Compute {i} + 2", "gold": str(i + 2)} for i in range(6)
    ]
    long_question = " + ".join(str(i % 10) for i in range(400))  # far past 128 tokens
    rows.insert(3, {"id": "too-long", "question": f"Compute {long_question}", "gold": "0"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


async def test_serve_links_over_curve_from_config_and_skips_a_prompt_that_cannot_fit(
    tmp_path: Path, long_tail_model: Path
) -> None:
    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "server")
    client_public, client_secret = zmq.auth.create_certificates(tmp_path, "client")
    data = tmp_path / "tasks.jsonl"
    _write_tasks(data)
    port = free_port("127.0.0.1")
    config = _config(
        tmp_path,
        long_tail_model,
        f"serve.port={port}",
        f"serve.link_server_key={json.dumps(str(server_secret))}",
        f"serve.link_client_key={json.dumps(str(client_public))}",
        f"data.source={json.dumps(str(data))}",
    )
    trainer = ToyTrainer(
        f"tcp://127.0.0.1:{port}",
        model_dir=long_tail_model,
        steps=STEPS,
        batch_size=B,
        timeout_s=60,
        link_config=ServeConfig(
            link_server_key=str(server_public), link_client_key=str(client_secret), token=TOKEN
        ),
    )
    trainer.start()
    run_dir = tmp_path / "run"
    await asyncio.wait_for(serve_in_process(config, run_dir=run_dir, progress=False), 90)
    await asyncio.to_thread(trainer.join)

    assert trainer.trained == list(range(STEPS)) and trainer.shutdown
    prompts = {g.prompt_id for _, g in trainer.received}
    assert len(trainer.received) == STEPS * B
    assert "too-long" not in prompts and prompts <= {f"short-{i}" for i in range(6)}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["extra"]["prompts_skipped"] == 1, summary["extra"]
    assert summary["extra"]["eval_prompts_skipped"] == 0
