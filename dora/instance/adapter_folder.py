"""The peft adapter folder, as the trainer publishes a LoRA version and instances load it.

A published version is `adapter_model.safetensors` (peft's tensor names, the scaling folded into
each `B`) and an `adapter_config.json` with `lora_alpha = r`, so scale 1: peft, vLLM and the
embedded engine load it as it is. The config is read off the tensors' names and shapes alone, so
both the trainer (torch tensors) and an instance client (raw bytes of the inline transport) write
the same file without torch or the LoRA settings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FILE", "adapter_config"]

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def adapter_config(
    shapes: Iterable[tuple[str, Sequence[int]]], *, base_model: str = ""
) -> dict[str, object]:
    """`adapter_config.json` of published adapter tensors (name, shape): their one rank (`lora_A`
    is `[r, in]`), the modules they target, scale 1. A mix of ranks is refused (ValueError)."""
    ranks: set[int] = set()
    modules: set[str] = set()
    for name, shape in shapes:
        module = name.split(".lora_")[0].rsplit(".", 1)[-1]
        modules.add(module)
        if ".lora_A." in name:
            ranks.add(int(shape[0]))
    if len(ranks) != 1:
        raise ValueError(f"adapter tensors of ranks {sorted(ranks)}: expected exactly one rank")
    [rank] = ranks
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
