"""LoRA for `dora learn` (`model.lora.rank > 0`): the trainer trains adapters, every version is one.

With LoRA the base model is frozen and each targeted linear layer gets `peft`'s low-rank pair
`y = W x + s * B (A x)` (`s = alpha / rank`). Only `A` and `B` are trained, sit in the optimizer
and are published, so a version is kilobytes to megabytes instead of the whole model.

What is published (both weight transports carry the same tensors):
- names as in peft's adapter files, `base_model.model.<module path>.lora_A.weight` (`[r, in]`) and
  `....lora_B.weight` (`[out, r]`);
- `B` with the scaling folded in (`s * B`), so that a consumer needs no LoRA settings: the delta of
  a module is exactly `B (A x)`. The filesystem transport writes a peft adapter folder
  (`adapter_model.safetensors`, `adapter_config.json` with `lora_alpha = r`, i.e. `s = 1`), which
  peft and vLLM load as it is.

Version 0 is the base model itself: peft starts `B` at zero, so the untrained adapter is no change.
Checkpoints hold the adapter as peft saves it (its own `alpha`, `B` unscaled) plus the optimizer
state of the adapter parameters; `resume_lora` attaches it, trainable, to a fresh base model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dora.config_sections import LoraSettings
from dora.instance.adapter_folder import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config


def enabled(settings: LoraSettings) -> bool:
    return settings.rank > 0


def peft_config(settings: LoraSettings) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """`model` with fresh adapters (`B = 0`: the same function as the base); only they train."""
    from peft import get_peft_model

    peft_model: torch.nn.Module = get_peft_model(model, peft_config(settings))
    if settings.dropout > 0:
        peft_model.train()  # peft applies the adapters' dropout in training mode only
    return peft_model


def resume_lora(
    model: torch.nn.Module, adapter_dir: Path, settings: LoraSettings
) -> torch.nn.Module:
    """`model` (the base) with the checkpoint's adapter at `adapter_dir`, trainable."""
    from peft import PeftModel

    saved = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if int(saved["r"]) != settings.rank:
        from dora.errors import ConfigError

        raise ConfigError(
            f"model.lora.rank = {settings.rank}, but the checkpoint's adapter has rank "
            f"{saved['r']}: resume with the rank it was trained with"
        )
    peft_model: torch.nn.Module = PeftModel.from_pretrained(
        model,
        str(adapter_dir),
        is_trainable=True,
    )
    if settings.dropout > 0:
        peft_model.train()
    return peft_model


def adapter_tensors(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The published version: the adapter tensors of `state_dict` (the peft model's full state,
    as `full_state_dict` gathers it), named as in peft's files, `B` times its module's scaling."""
    from peft import get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    hf: Any = model
    adapters = get_peft_model_state_dict(hf, state_dict=dict(state_dict))
    scaling = {
        name: float(module.scaling["default"])
        for name, module in hf.named_modules()
        if isinstance(module, LoraLayer)
    }
    out: dict[str, torch.Tensor] = {}
    for name, tensor in adapters.items():
        tensor = tensor.detach().cpu().clone()  # a copy: training goes on moving the parameter
        if ".lora_B." in name:
            tensor *= scaling[name.split(".lora_B.")[0]]
        out[name] = tensor.contiguous()
    return out


def save_published_adapter(
    folder: Path, tensors: Mapping[str, torch.Tensor], *, base_model: str
) -> None:
    """Write published adapter tensors as a peft adapter folder of scaling 1 (`lora_alpha = r`)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(folder / ADAPTER_FILE))
    config = adapter_config(((n, t.shape) for n, t in tensors.items()), base_model=base_model)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
