"""`dora learn` with `model.lora.rank > 0`: only the adapters train, every published version is the
adapter alone (both transports), checkpoints hold the adapter and its optimizer state, and
`--resume` continues exactly where the checkpoint left off."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from learn_standin import StandIn, completion_logprob, learn_args, run_learn_in_thread
from test_learn_loop import REWARDED, on_policy_groups, write_config

from dora.learn.checkpoint import latest_checkpoint
from dora.models import TinyModelSpec, build_tiny_model
from dora.protocol import StepDone, WeightChunk, WeightsReady

pytestmark = pytest.mark.timeout(300)

LORA = ["model.lora.rank=8", "model.lora.alpha=16"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", TinyModelSpec(seed=1))


def _adapter_only(state: dict[str, torch.Tensor], rank: int = 8) -> None:
    assert state and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in state)
    assert all(n.startswith("base_model.model.model.layers.") for n in state)
    assert {t.shape[0] for n, t in state.items() if ".lora_A." in n} == {rank}


def _is_small_adapter_folder(folder: Path, model_dir: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    model_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert (folder / "adapter_model.safetensors").stat().st_size < model_bytes / 2


async def test_lora_trains_publishes_adapters_checkpoints_and_resumes(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin = StandIn(tiny_dir)
    monkeypatch.setenv("DORA_SERVE_ADDRESS", standin.link.address)
    config = write_config(
        tmp_path,
        tiny_dir,
        steps=4,
        lr=2e-2,
        checkpoint_every=2,
        weight_transport="filesystem",
        off_policy="tis",
        micro_batch_tokens=128,
    )
    before = completion_logprob(standin.model, standin.tokenizer, REWARDED)
    make = on_policy_groups(standin)
    try:
        learner = await run_learn_in_thread(learn_args(config, *LORA))
        record = await standin.serve(range(4), make)
        assert await asyncio.wait_for(learner, 120) == 0
        await standin.drain()
        ready = record.of(WeightsReady)
        assert [w.version for w in ready] == [1, 2, 3, 4]
        folder = Path(ready[-1].path)
        _is_small_adapter_folder(folder, tiny_dir)
        for v in (1, 2, 3, 4):
            _adapter_only(standin.published[v])
        b_norms = [
            sum(float(t.abs().sum()) for n, t in standin.published[v].items() if "lora_B" in n)
            for v in (1, 4)
        ]
        assert 0 < b_norms[0] < b_norms[1]  # B starts at zero and moves

        # a published folder is a peft adapter (scaling folded in) of the same function
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_dir), str(folder)
        ).eval()
        ids = torch.tensor([list(range(3, 20))])
        with torch.no_grad():
            torch.testing.assert_close(
                peft_model(input_ids=ids).logits,
                standin.model(input_ids=ids).logits,
                atol=1e-5,
                rtol=0,
            )

        # the checkpoint: the adapter as peft saves it, and the adapters' optimizer state only
        ckpt = latest_checkpoint(tmp_path / "run")
        assert ckpt is not None and (ckpt.step, ckpt.version) == (3, 4)
        saved = json.loads((ckpt.model_dir / "adapter_config.json").read_text())
        assert (saved["r"], saved["lora_alpha"]) == (8, 16)
        optimizer = torch.load(ckpt.path / "optimizer.pt", weights_only=True)
        lora_params = len(standin.published[4])
        assert len(optimizer["state"]) == lora_params

        # --resume re-publishes the checkpoint's version exactly, then trains on
        resumed = learn_args(config, *LORA, "learn.steps=6", resume=True)
        learner = await run_learn_in_thread(resumed)
        again = dict(standin.published[4])
        record = await standin.serve(range(4, 6), make)
        assert await asyncio.wait_for(learner, 120) == 0
        await standin.drain()
        assert [w.version for w in record.of(WeightsReady)[4:]] == [4, 5, 6]
        assert set(standin.published[4]) == set(again)
        for name, tensor in again.items():
            torch.testing.assert_close(standin.published[4][name], tensor, atol=0, rtol=0)
        after = completion_logprob(standin.model, standin.tokenizer, REWARDED)
        rewards = [d.metrics["reward_mean"] for d in record.of(StepDone)]
        print(f"log p({REWARDED!r}) {before:.2f} -> {after:.2f}; rewards {rewards}")
        assert after > before + 1.0
    finally:
        standin.close()


async def test_lora_inline_chunks_carry_the_adapter_only(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin = StandIn(tiny_dir)
    monkeypatch.setenv("DORA_SERVE_ADDRESS", standin.link.address)
    config = write_config(tmp_path, tiny_dir, steps=1, weight_transport="inline")
    try:
        learner = await run_learn_in_thread(
            learn_args(config, "model.lora.rank=4", "model.lora.target_modules=['q_proj']")
        )
        record = await standin.serve(range(1), on_policy_groups(standin))
        assert await asyncio.wait_for(learner, 120) == 0
        await standin.drain()
        chunks = record.of(WeightChunk)
        assert len(chunks) == 1 and record.of(WeightsReady)[0].num_chunks == 1
        state = standin.published[1]
        _adapter_only(state, rank=4)
        assert {n.split(".")[-3] for n in state} == {"q_proj"}
        assert len(state) == 2 * 2  # two layers, A and B each
    finally:
        standin.close()
