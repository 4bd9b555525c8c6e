"""The embedded engine computes on its model's device: every tensor the batcher, the KV cache,
the sampler, the fused decode step and the LoRA adapters create is made on the device of the
model's weights, never on torch's default device.

A machine without a GPU cannot put the model on CUDA, so the tests turn it around: the model stays
on the CPU and torch's default device becomes `meta` while the engine runs. A tensor created
without `device=` then lands on `meta` and the step fails (a meta tensor mixed with the model's
CPU tensors, or read back with `.tolist()`), exactly where it would land on the CPU beside a CUDA
model. The decoded tokens must also be the ones the engine decodes without the trap.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from dora.config_sections import LoraSettings
from dora.engine.batcher import Batcher
from dora.engine.sequence import Sequence
from dora.learn.lora import adapter_tensors, apply_lora
from dora.protocol import SamplingParams
from tests.unit.engine.test_fused import _batcher
from tests.unit.engine.test_fused import _model as fused_model

pytestmark = pytest.mark.timeout(180)


@contextmanager
def default_device_meta() -> Iterator[None]:
    """Every factory call without `device=` makes a meta tensor while this is open."""
    with torch.device("meta"):
        yield


def _params(i: int) -> SamplingParams:
    """Every optional part of sampling: greedy, top-k, top-p, min tokens, stop ids."""
    return [
        SamplingParams(max_tokens=9, seed=i),
        SamplingParams(max_tokens=9, seed=i, temperature=0.0),
        SamplingParams(max_tokens=9, seed=i, top_k=5, top_p=0.8, temperature=0.7),
        SamplingParams(max_tokens=9, seed=i, min_tokens=4, stop_token_ids=[7]),
    ][i % 4]


def _decode(b: Batcher, *, trap: bool, versions: list[int | None]) -> list[Sequence]:
    seqs = [
        b.new_sequence(f"r{i}", list(range(3, 6 + i % 3)), _params(i), version=v)
        for i, v in enumerate(versions)
    ]
    with default_device_meta() if trap else _nothing():
        b.add_all(seqs)
        while b.has_work():
            b.step()
    return seqs


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "hf"])
def test_a_generation_creates_no_tensor_off_the_models_device(fused: bool) -> None:
    torch.manual_seed(0)
    model = fused_model("llama", num_key_value_heads=2)
    seen = _decode(_batcher(model, fused=fused), trap=True, versions=[None] * 6)
    plain = _decode(_batcher(model, fused=fused), trap=False, versions=[None] * 6)
    assert [s.finish_reason for s in seen] == [s.finish_reason for s in plain]
    assert [s.token_ids for s in seen] == [s.token_ids for s in plain]
    assert all(s.token_ids for s in seen)


def test_adapter_versions_and_kv_moves_stay_on_the_models_device() -> None:
    torch.manual_seed(0)
    base = fused_model("llama", num_key_value_heads=2)
    peft = apply_lora(copy.deepcopy(base), LoraSettings(rank=4, alpha=8)).eval()
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * 0.3)
    adapter = adapter_tensors(peft, peft.state_dict())
    b = _batcher(base, fused=True)
    with default_device_meta():
        b.load_adapter(1, adapter, keep=False)
    seqs = _decode(b, trap=True, versions=[0, 1, None, 1])
    assert all(s.versions and set(s.versions) <= {0, 1} for s in seqs)
    # a sequence leaves with its KV cache and continues in another engine
    moving = b.new_sequence("m", [3, 4, 5, 6], SamplingParams(max_tokens=12, seed=3))
    other = _batcher(base, fused=True)
    with default_device_meta():
        b.add(moving)
        b.step()
        b.step()
        kv = b.detach(moving)
        assert kv is not None and kv.device == torch.device("cpu")
        moved = Sequence(
            id="m",
            prompt_ids=moving.prompt_ids,
            params=moving.params,
            key=moving.key,
            token_ids=list(moving.token_ids),
            logprobs=list(moving.logprobs),
            versions=list(moving.versions),
            kv_import=kv,
        )
        other.add(moved)
        while other.has_work():
            other.step()
    assert moved.finish_reason == "length" and len(moved.token_ids) == 12


def test_an_engine_asked_for_cuda_without_one_is_refused_naming_what_it_sees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dora.engine.server import load_model
    from dora.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=''"):
        load_model("/nonexistent", "float32", "cuda")
