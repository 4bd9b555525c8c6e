"""`dora export`: a LoRA adapter merged into its base gives the base-plus-adapter logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dora.cli import main
from dora.config_sections import LoraSettings
from dora.learn.lora import adapter_tensors, apply_lora, save_published_adapter
from dora.models import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A base model folder and a peft model on it whose adapters moved away from zero."""
    base = build_tiny_model(tmp_path / "base", TinyModelSpec(hidden_size=64, seed=2))
    settings = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(base), settings).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return base, peft_model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(range(3, 30))])).logits


def test_export_of_a_checkpoint_adapter_gives_base_plus_adapter_logits(
    tmp_path: Path, trained: tuple[Path, torch.nn.Module]
) -> None:
    base, peft_model = trained
    ckpt = tmp_path / "run" / "checkpoints" / "step-000003"
    peft_model.save_pretrained(ckpt / "model")  # type: ignore[operator]  # as commit_checkpoint
    AutoTokenizer.from_pretrained(base).save_pretrained(ckpt / "model")
    (ckpt.parent / "latest").write_text("step-000003\n")
    (ckpt / "trainer.json").write_text('{"step": 3, "version": 4, "incarnation": 0}\n')
    out = tmp_path / "merged"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    AutoTokenizer.from_pretrained(out)
    torch.testing.assert_close(_logits(merged), _logits(peft_model), atol=1e-5, rtol=0)
    assert (
        _logits(merged) - _logits(AutoModelForCausalLM.from_pretrained(base))
    ).abs().max() > 1e-2


def test_export_of_a_published_version_with_an_explicit_base(
    tmp_path: Path, trained: tuple[Path, torch.nn.Module]
) -> None:
    base, peft_model = trained
    published = tmp_path / "weights" / "v000004"
    tensors = adapter_tensors(peft_model, peft_model.state_dict())
    save_published_adapter(published, tensors, base_model="/nonexistent")
    out = tmp_path / "merged"
    with pytest.raises(Exception, match="not a Hugging Face model folder"):
        from dora.learn.export import export_merged

        export_merged(published, out)
    assert main(["export", str(published), str(out), "--base", str(base)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logits(merged), _logits(peft_model), atol=1e-5, rtol=0)


def test_export_refuses_a_full_weight_checkpoint(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "ckpt" / "model", TinyModelSpec(hidden_size=32))
    assert model.is_dir()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 1
