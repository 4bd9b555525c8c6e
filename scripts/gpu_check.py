"""The GPU check (scripts/gpu-check.sh runs it): three parts, each printing its figures.

1. `engine`: the embedded engine decodes a batch of a tiny model (on the CPU: the engine has no
   CUDA path) and its behaviour logprobs are compared with a forward pass of the same weights on
   DEVICE; `model.generate` on DEVICE gives the reference throughput.
2. `trainer`: one trainer step (dora's packing, loss and AdamW) of the same groups on the CPU and
   on DEVICE; the logprobs before the step and the parameters after it must match within
   tolerance.
3. `run`: `dora run` of the math example for a few steps, the trainer on DEVICE where the plan
   gives it a GPU, in bfloat16 on a GPU; first its `--dry-run` placement.

`--cpu` runs every part with DEVICE = cpu (what a machine without a GPU can check). Exit status 1
when a comparison is out of tolerance or the run fails.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def engine_part(device: str, model_dir: Path) -> bool:
    import torch
    from transformers import AutoModelForCausalLM

    from dora.engine.batcher import Batcher, BatcherConfig
    from dora.engine.server import load_model
    from dora.protocol import SamplingParams

    model, tok = load_model(model_dir, "float32")
    batcher = Batcher(
        model,
        eos_token_ids=[],
        decode=tok.decode,  # type: ignore[attr-defined]
        config=BatcherConfig(max_running=32),
    )
    seqs = [
        batcher.new_sequence(f"r{i}", list(range(3, 13)), SamplingParams(max_tokens=64, seed=i))
        for i in range(32)
    ]
    start = time.perf_counter()
    for s in seqs:
        batcher.add(s)
    while batcher.has_work():
        batcher.step()
    engine_s = time.perf_counter() - start
    tokens = sum(len(s.token_ids) for s in seqs)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    worst = 0.0
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s.prompt_ids + s.token_ids], device=device)
            logp = torch.log_softmax(ref(ids).logits[0].float(), -1)[len(s.prompt_ids) - 1 : -1]
            got = logp.gather(1, torch.tensor(s.token_ids, device=device)[:, None])[:, 0]
            worst = max(worst, float((got.cpu() - torch.tensor(s.logprobs)).abs().max()))
        prompts = torch.tensor([list(range(3, 13))] * 32, device=device)
        start = time.perf_counter()
        out = ref.generate(prompts, max_new_tokens=64, min_new_tokens=64, do_sample=True)
        if device == "cuda":
            torch.cuda.synchronize()
        generate_s = time.perf_counter() - start
    generated = (out.shape[1] - prompts.shape[1]) * out.shape[0]
    ok = worst < 1e-3
    print(
        f"engine: {tokens} tokens in {engine_s:.2f} s ({tokens / engine_s:.0f} tok/s, engine on "
        f"cpu); model.generate on {device}: {generated / generate_s:.0f} tok/s; behaviour "
        f"logprobs vs a forward on {device}: max |diff| {worst:.2e} ({'ok' if ok else 'FAIL'})"
    )
    return ok


def trainer_part(device: str, model_dir: Path) -> bool:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from dora.bench.training import synthetic_group, train_step
    from dora.config import load_config

    config = load_config(None, ["rollout.group_size=8", "learn.lr=1e-4"])
    rng = np.random.default_rng(0)
    groups = [
        synthetic_group(rng, vocab=64, prompt=12, answers=[20 + 5 * i for i in range(8)], gid=g)
        for g in ("a", "b", "c", "d")
    ]
    models = {}
    for where in ("cpu", device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(where)
        model.train()
        before = copy.deepcopy({k: v.detach().cpu() for k, v in model.state_dict().items()})
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learn.lr)
        start = time.perf_counter()
        train_step(model, optimizer, groups, config=config, packed=True)
        if where == "cuda":
            torch.cuda.synchronize()
        print(f"trainer: one step on {where}: {time.perf_counter() - start:.3f} s")
        models[where] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    moved = sum(float((models["cpu"][k] - before[k]).norm() ** 2) for k in before) ** 0.5
    apart = sum(float((models[device][k] - models["cpu"][k]).norm() ** 2) for k in before) ** 0.5
    ratio = apart / max(moved, 1e-12)
    ok = ratio < 0.05
    print(
        f"trainer: after one step, |params({device}) - params(cpu)| / |step| = {ratio:.2e} "
        f"({'ok' if ok else 'FAIL'}; tolerance 5e-2)"
    )
    return ok


def run_part(device: str, scratch: Path) -> bool:
    config = str(REPO / "examples/math/config.toml")
    settings = [
        "learn.steps=4",
        "model.warmup_steps=20",
        "data.eval_size=0",
        "log.progress=false",
        f"log.run_dir={scratch / 'run'}",
        *(["model.dtype=bfloat16"] if device == "cuda" else []),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DORA_CACHE": str(scratch / "cache")}
    dora = [sys.executable, "-m", "dora.cli", "run", config, *settings]
    plan = subprocess.run([*dora, "--dry-run"], env=env, capture_output=True, text=True)
    print(
        "\n".join(line for line in plan.stdout.splitlines() if line.startswith(("placement", "  ")))
    )
    start = time.perf_counter()
    done = subprocess.run(dora, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    ok = done.returncode == 0
    print(f"run: dora run of the math example, 4 steps: exit {done.returncode} in {wall:.0f} s")
    if not ok:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="every part on the CPU (no GPU needed)")
    p.add_argument("--parts", default="engine,trainer,run")
    args = p.parse_args()
    import torch

    from dora.models.tiny import TinyModelSpec, build_tiny_model

    if not args.cpu and not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible; run with --cpu for the CPU part", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda":
        print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    else:
        print(f"gpu-check --cpu: torch {torch.__version__}, no GPU used")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    results = {}
    with tempfile.TemporaryDirectory(prefix="dora-gpu-check-") as tmp:
        scratch = Path(tmp)
        model_dir = build_tiny_model(
            scratch / "tiny", TinyModelSpec(hidden_size=256, num_layers=4, num_heads=4)
        )
        parts = args.parts.split(",")
        if "engine" in parts:
            results["engine"] = engine_part(device, model_dir)
        if "trainer" in parts:
            results["trainer"] = trainer_part(device, model_dir)
        if "run" in parts:
            results["run"] = run_part(device, scratch)
    print("gpu-check: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
