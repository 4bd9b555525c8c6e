"""`dora export SOURCE OUT [--base DIR]`: a LoRA run's adapter merged into its base model.

SOURCE is a run directory (its latest checkpoint), one checkpoint (`checkpoints/step-000009`), or
an adapter folder (a checkpoint's `model/`, or a published version `weights/v000010`). The base
model is `--base`, else the folder the adapter names (`base_model_name_or_path`, which the trainer
sets to the initial model it trained on). OUT becomes a plain Hugging Face model folder, the
weights `W + s * B A` in float32, with the tokenizer: transformers and vLLM load it without peft.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dora.errors import ConfigError
from dora.learn.checkpoint import latest_checkpoint
from dora.learn.lora import ADAPTER_CONFIG


def adapter_folder(source: Path) -> Path:
    """The adapter folder SOURCE stands for (see the module docstring)."""
    if (source / "checkpoints").is_dir():
        checkpoint = latest_checkpoint(source)
        if checkpoint is None:
            raise ConfigError(f"{source}: the run directory holds no complete checkpoint")
        source = checkpoint.path
    for folder in (source, source / "model"):
        if (folder / ADAPTER_CONFIG).is_file():
            return folder
    if (source / "model" / "config.json").is_file() or (source / "config.json").is_file():
        raise ConfigError(
            f"{source} holds full weights, not a LoRA adapter: its model folder is already a "
            "Hugging Face model (nothing to merge)"
        )
    raise ConfigError(f"{source}: neither a run directory, a checkpoint nor an adapter folder")


def export_merged(source: Path, out: Path, *, base: Path | None = None) -> Path:
    """Merge the adapter of `source` into its base and write `out`; return `out`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = adapter_folder(source)
    if base is None:
        named = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if not named:
            raise ConfigError(f"{folder}: the adapter names no base model; give --base")
        base = Path(named)
    if not (base / "config.json").is_file():
        raise ConfigError(f"base model {base} is not a Hugging Face model folder; give --base")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    tok_source = folder if (folder / "tokenizer_config.json").is_file() else base
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(tok_source).save_pretrained(out)
    return out


def main(args: argparse.Namespace) -> int:
    out = export_merged(
        Path(args.source), Path(args.out), base=Path(args.base) if args.base else None
    )
    print(f"merged model written to {out}")
    return 0
