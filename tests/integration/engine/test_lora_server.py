"""LoRA versions through the engine's HTTP control routes: adapters load by either transport
(raw tensors, or a published adapter folder), requests pinned to different versions run
together, and old adapters unload."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dora.config_sections import LoraSettings
from dora.engine import EngineClient, EngineServer
from dora.errors import RequestError, VersionMismatch
from dora.instance.interface import held_versions
from dora.learn.lora import adapter_tensors, apply_lora, save_published_adapter
from dora.models import TinyModelSpec, build_tiny_model
from dora.protocol import SamplingParams

pytestmark = pytest.mark.timeout(120)


def _raw(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return "float32", list(t.shape), flat


async def test_adapter_versions_over_http(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=64, seed=3))
    peft_model = apply_lora(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraSettings(rank=4, alpha=8)
    ).eval()
    states, published = {}, {}
    for v in (1, 2):
        gen = torch.Generator().manual_seed(v)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        states[v] = {n: p.clone() for n, p in peft_model.named_parameters() if "lora_" in n}
        published[v] = adapter_tensors(peft_model, peft_model.state_dict())
    folder = tmp_path / "v000002"
    save_published_adapter(folder, published[2], base_model=str(model_dir))

    def reference(version: int, prompt: list[int], tokens: Sequence[int]) -> torch.Tensor:
        tokens = list(tokens)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(states[version][name] if version else torch.zeros_like(p))
            logits = peft_model(input_ids=torch.tensor([prompt + tokens])).logits[0]
        lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
        return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]

    async with (
        EngineServer.start(model_dir, version=0, threads=1) as srv,
        EngineClient(srv.url) as client,
    ):
        one = await client.load_weights(1, tensors={n: _raw(t) for n, t in published[1].items()})
        assert one["versions"] == [0, 1]
        two = await client.load_weights(2, path=str(folder))
        assert (two["version"], two["previous_version"], two["versions"]) == (2, 1, [0, 1, 2])
        health = await client.health()
        assert (health["version"], held_versions(health)) == (2, [0, 1, 2])
        prompt = [5, 6, 7, 8]
        params = SamplingParams(max_tokens=12, seed=7, ignore_eos=True)
        outs = await asyncio.gather(
            *(
                client.generate(prompt, params, request_id=f"r{i}", version=v)
                for i, v in enumerate((0, 1, 2, 1, 2, 0))
            )
        )
        for v, out in zip((0, 1, 2, 1, 2, 0), outs, strict=True):
            assert list(out.versions) == [v] * 12
            torch.testing.assert_close(
                torch.tensor(out.logprobs), reference(v, prompt, out.token_ids), atol=1e-4, rtol=0
            )
        ids = [list(out.token_ids) for out in outs]
        assert ids[0] == ids[5]  # the same seed, version and prompt
        unpinned = await client.generate(prompt, params, request_id="free")
        assert list(unpinned.versions) == [2] * 12 and list(unpinned.token_ids) == ids[2]

        with pytest.raises(VersionMismatch, match="newest"):
            await client.unload_weights(2)
        assert (await client.unload_weights(1))["versions"] == [0, 2]
        with pytest.raises(RequestError, match="404"):
            await client.unload_weights(1)
        with pytest.raises(VersionMismatch):
            await client.generate(prompt, params, request_id="late", version=1)


def test_held_versions_of_a_backend_that_reports_one() -> None:
    assert held_versions({"status": "ok", "version": 4}) == [4]
    assert held_versions({"version": 4, "versions": [4, 2]}) == [2, 4]
    with pytest.raises(ValueError, match="version"):
        held_versions({"status": "ok"})
