"""Things outside `dora serve` that restart or were started elsewhere.

A trainer that crashes and restarts from its checkpoint (docs/reliability.md): `dora serve` rolls
back.

The first trainer trains steps 0..4, makes steps 1 and 3 durable, and dies without a word before
step 4's checkpoint. A second trainer (incarnation 1) resumes at step 4 from the checkpoint of
step 3. Serve must offer it every step from 4 on with exactly B groups; groups of the version the
new trainer will not reproduce (5, published by the lost step 4) are removed, never sent; the
durable steps 0..3 are not sent again; C1 and C3 hold for everything the new trainer trains.

Engines already running (`serve.urls`) are attached, reset to version 0, and left running.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from serve_helpers import on_free_port, serve_in_process
from serve_trainer import ToyTrainer, check_resumed, dying_trainer, restart_config, resumed_trainer

from dora.config import load_config
from dora.serve.main import run_serve

pytestmark = pytest.mark.timeout(180)

STEPS, B, K = 8, 2, 2


async def test_trainer_restart_rolls_back(tmp_path: Path, long_tail_model: Path) -> None:
    config = restart_config(tmp_path, long_tail_model, steps=STEPS, batch_size=B, k=K)
    config, address = on_free_port(config)
    first = dying_trainer(address, long_tail_model, steps=STEPS, batch_size=B)
    first.start()
    serve = asyncio.ensure_future(serve_in_process(config, run_dir=tmp_path))
    try:
        await asyncio.to_thread(first.join, 60)
        assert first.trained == [0, 1, 2, 3, 4]
        # The restart takes a while: meanwhile serve loads version 5 (published by the lost
        # step 4) and starts groups on it, which the roll-back must remove.
        await asyncio.sleep(2.0)
        second = resumed_trainer(address, long_tail_model, steps=STEPS, batch_size=B)
        second.start()
        report = await asyncio.wait_for(serve, 120)
        await asyncio.to_thread(second.join)
    finally:
        serve.cancel()

    check_resumed(first, second, steps=STEPS, k=K)
    records = [json.loads(x) for x in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    rollbacks = [r for r in records if r["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["step"] == 3
    assert rollbacks[0]["rolled_back"] > 0, "groups of the ghost version were removed"
    assert report.steps == STEPS  # type: ignore[attr-defined]


async def test_attach_to_running_engines(tmp_path: Path, long_tail_model: Path) -> None:
    """`serve.urls`: engines started elsewhere (here: in this process, left at another version)
    are attached, reset to version 0, used, and left running."""
    from dora.serve.instances import InstanceSpec, start_in_process

    spec = InstanceSpec(model_dir=str(long_tail_model), max_running=8, max_model_len=256)
    async with start_in_process(spec, 2) as engines:
        for h in engines:
            await h.client.load_weights(7, path=str(long_tail_model))
        steps = 3
        config = load_config(
            None,
            [
                f"model.path={json.dumps(str(long_tail_model))}",
                "model.max_model_len=256",
                f"serve.urls={json.dumps([h.url for h in engines])}",
                "serve.max_running=8",
                "rollout.group_size=2",
                f"rollout.batch_size={B}",
                "rollout.max_tokens=24",
                "rollout.max_turns=1",
                f"learn.steps={steps}",
                f"log.run_dir={json.dumps(str(tmp_path))}",
                "log.progress=false",
            ],
        )
        config, address = on_free_port(config)
        trainer = ToyTrainer(address, model_dir=long_tail_model, steps=steps, batch_size=B)
        trainer.start()
        await asyncio.wait_for(run_serve(config, run_dir=tmp_path), 120)
        await asyncio.to_thread(trainer.join)
        assert sorted(trainer.by_step) == list(range(steps))
        for step, group in trainer.received:
            assert 0 <= step - group.version <= K
            for s in group.samples:
                assert (s.token_versions()[s.mask() == 1] == group.version).all()
        for h in engines:  # still running, not stopped by dora serve
            assert (await h.client.health())["status"] == "ok"
