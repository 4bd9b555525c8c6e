"""The trainer's packed micro-batch (a group's prompt once, `learn.shared_prefix`) against one
padded row per sequence, on a CUDA device or the CPU: the same logprobs, loss and gradients, and
what each costs in time (and on CUDA, memory) at several prompt and answer lengths.

The model is a randomly initialised Llama with SDPA attention (what the trainer runs), of
SmolLM2-135M's shape or the tiny benchmark model's (`--shape tiny`); each micro-batch is one whole
group of `G` answers to one prompt, run through the trainer's own code (`collate`,
`forward_logprobs`, `policy_loss`, backward), in bfloat16 on CUDA and float32 on the CPU. Prints
a table and, with `--out`, writes the results as JSON.

    python scripts/check-packing.py --out packing-gpu.json                # on a GPU machine
    python scripts/check-packing.py --device cpu --shape tiny --cases math,1k
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from dora.bench.training import micro_batch_backward, synthetic_group
from dora.config import LearnConfig
from dora.learn.batching import (
    packs,
    plan_micro_batches,
    shared_prefix,
)
from dora.learn.loss import LossSettings
from dora.models.tiny import TinyModelSpec

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=16384,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
_SPEC = TinyModelSpec()  # the tiny benchmark model's shape, its defaults
TINY = dict(
    hidden_size=_SPEC.hidden_size,
    intermediate_size=_SPEC.intermediate_size,
    num_hidden_layers=_SPEC.num_layers,
    num_attention_heads=_SPEC.num_heads,
    num_key_value_heads=_SPEC.num_heads,
    vocab_size=128,
    max_position_embeddings=16384,
)
# (name, prompt tokens, answer lengths' range): the math example's shape, then reasoning lengths
CASES = [
    ("math", 94, (20, 120)),
    ("1k", 256, (200, 1500)),
    ("4k", 512, (1000, 4000)),
    ("8k", 1024, (2000, 8000)),
]


def step(model: Any, items: list, *, packed: bool, dtype: torch.dtype) -> tuple[Any, float]:
    """One micro-batch: its trained tokens' logprobs (0 elsewhere) and its loss, after its
    backward."""
    mb, logprobs, _, loss = micro_batch_backward(
        model, items, packed=packed, settings=LossSettings(), dtype=dtype
    )
    return (logprobs.detach() * (mb.weights > 0)).float(), loss


def parity(model: Any, items: list, dtype: torch.dtype) -> dict[str, float]:
    """Packed against padded on the same group: logprob, loss and gradient differences."""
    out = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        lp, loss = step(model, items, packed=packed, dtype=dtype)
        grads = [p.grad.detach().float().clone() for p in model.parameters()]
        out[packed] = (lp, loss, grads)
    (lp0, l0, g0), (lp1, l1, g1) = out[False], out[True]
    rel = [float((a - b).norm() / a.norm().clamp_min(1e-30)) for a, b in zip(g0, g1, strict=True)]
    return {
        "max_logprob_diff": float((lp0 - lp1).abs().max()),
        "loss_rel_diff": abs(l0 - l1) / max(abs(l0), 1e-30),
        "max_grad_rel_diff": max(rel),
    }


Batches = list[tuple[list, bool]]  # micro-batches: (items, packed)


def timing(model: Any, batches: Batches, *, repeats: int, dtype: torch.dtype) -> dict[str, Any]:
    """Milliseconds per forward+backward of the group's micro-batches, per trained token, and
    peak memory (CUDA)."""
    trained = sum(int(it.loss_mask.sum()) for items, _ in batches for it in items)
    cuda = next(model.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def run() -> None:
        model.zero_grad(set_to_none=True)
        for items, packed in batches:
            step(model, items, packed=packed, dtype=dtype)
        if cuda:
            torch.cuda.synchronize()

    try:
        for _ in range(2):
            run()
        t = time.perf_counter()
        for _ in range(repeats):
            run()
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return {"ms": None, "us_per_trained": None, "peak_gib": None, "error": "out of memory"}
    ms = 1e3 * (time.perf_counter() - t) / repeats
    return {
        "ms": ms,
        "us_per_trained": 1e3 * ms / trained,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def trainers_plan(items: list) -> Batches:
    """The micro-batches the trainer runs for this group at the default `learn.*` settings."""
    learn = LearnConfig()
    plan = plan_micro_batches(
        [it.length for it in items],
        world=1,
        budget=learn.micro_batch_tokens,
        shared=shared_prefix(items),
        row_cap=learn.shared_prefix_tokens,
    )
    batches = [[items[i] for i in b] for b in plan[0]]
    return [(b, packs(b, learn.shared_prefix_tokens)) for b in batches]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--group", type=int, default=8, help="answers per prompt (G)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=["smollm2-135m", "tiny"], default="smollm2-135m")
    p.add_argument("--cases", default=",".join(c[0] for c in CASES), help="which of the cases")
    p.add_argument("--parity-only", action="store_true", help="skip the timings")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    torch.manual_seed(0)
    dims: dict[str, Any] = SMOLLM2_135M if args.shape == "smollm2-135m" else TINY
    config = LlamaConfig(**dims)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(args.device).train()
    vocab = int(dims["vocab_size"])
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rng = np.random.default_rng(0)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results: dict[str, Any] = {"device": name, "torch": torch.__version__, "shape": args.shape}

    group = synthetic_group(rng, vocab=vocab, prompt=300, answers=rng.integers(50, 700, args.group))
    results["parity_fp32"] = parity(model.float(), group, torch.float32)
    if dtype == torch.bfloat16:
        results["parity_bf16"] = parity(model.to(dtype), group, dtype)
    for name in ("parity_fp32", "parity_bf16")[: 2 if dtype == torch.bfloat16 else 1]:
        print(name, {k: f"{v:.2e}" for k, v in results[name].items()})
    if args.parity_only:
        return 0

    print(
        f"{'case':>5} {'row':>6} {'ms padded':>10} {'ms packed':>10} {'ms trainer':>10} "
        f"{'GiB pad':>8} {'GiB pack':>8} {'pad/pack':>8}  trainer's micro-batches"
    )
    results["timing"] = []
    for name, prompt, (lo, hi) in CASES:
        if name not in args.cases.split(","):
            continue
        answers = rng.integers(lo, hi, args.group)
        items = synthetic_group(rng, vocab=vocab, prompt=prompt, answers=answers)
        row = prompt + int(answers.sum())
        plan = trainers_plan(items)
        took = {
            kind: timing(model, batches, repeats=args.repeats, dtype=dtype)
            for kind, batches in (
                ("padded", [(items, False)]),
                ("packed", [(items, True)]),
                ("trainer", plan),
            )
        }
        pad, pack = took["padded"]["ms"], took["packed"]["ms"]
        ratio = pad / pack if pad and pack else None
        shape = ", ".join(f"{len(b)} {'packed' if p else 'padded'}" for b, p in plan)
        results["timing"].append(
            {
                "case": name,
                "prompt": prompt,
                "answers": answers.tolist(),
                "row": row,
                **took,
                "padded_over_packed": ratio,
                "trainer_plan": shape,
            }
        )

        def f(x: float | None, spec: str) -> str:
            return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))

        print(
            f"{name:>5} {row:>6} {f(pad, '10.1f')} {f(pack, '10.1f')} "
            f"{f(took['trainer']['ms'], '10.1f')} {f(took['padded']['peak_gib'], '8.1f')} "
            f"{f(took['packed']['peak_gib'], '8.1f')} {f(ratio, '8.2f')}  {shape}"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
