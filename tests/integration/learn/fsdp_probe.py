"""Run under torchrun by the FSDP tests: every rank loads a checkpoint exactly as a resumed
`dora learn` with `learn.strategy = "fsdp"` does (`FullySharded.prepare`), and writes what it then
holds, its own shard of every parameter and of every optimizer state tensor, to `OUT/rank{r}.pt`.

    torchrun --standalone --nproc_per_node 2 fsdp_probe.py CHECKPOINT_DIR OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

from dora.learn.parallel import FullySharded


def main(checkpoint: Path, out: Path) -> None:
    accelerator = Accelerator(cpu=True)
    parallel = FullySharded(accelerator)
    model = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
    model, optimizer, _ = parallel.prepare(
        model, lambda params: torch.optim.AdamW(params, lr=1e-3), checkpoint
    )
    names = {param: name for name, param in model.named_parameters()}
    held: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            held[f"optimizer/{names[param]}/{key}"] = local.detach().clone()
    for name, param in model.named_parameters():
        held[f"param/{name}"] = param.to_local().detach().clone()  # type: ignore[operator]
    out.mkdir(parents=True, exist_ok=True)
    torch.save(held, out / f"rank{accelerator.process_index}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
