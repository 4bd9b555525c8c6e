"""The GPU check (scripts/gpu-check.sh runs it): four parts, each printing its figures.

1. `engine`: the embedded engine, its model on DEVICE, decodes a batch of a tiny model and its
   behaviour logprobs are compared with a forward pass of the same weights on DEVICE
   (`model.generate` on DEVICE gives the reference throughput); then it loads new weights from
   host memory, as a load brings them, and decodes again under them, compared the same way.
2. `trainer`: one trainer step (dora's packing, loss and AdamW) of the same groups on the CPU and
   on DEVICE; the logprobs before the step and the parameters after it must match within
   tolerance.
3. `nccl`: trainer rank 0's broadcast of a published version (`dora.learn.nccl`) to receivers
   that follow serve's `/update_weights` body, over a gloo stand-in group (tensors on DEVICE),
   and whether vLLM's NCCL group can be opened here (or the refusal that says why not).
4. `run`: `dora run` of the math example for a few steps; on a GPU one engine and the trainer
   share it (`run.colocate`), in bfloat16; first its `--dry-run` placement.

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
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def engine_part(device: str, model_dir: Path) -> bool:
    import torch
    from transformers import AutoModelForCausalLM

    from dora.engine.batcher import Batcher, BatcherConfig
    from dora.engine.server import load_model
    from dora.engine.worker import EngineWorker

    model, tok = load_model(model_dir, "float32", device)
    batcher = Batcher(
        model,
        eos_token_ids=[],
        decode=tok.decode,  # type: ignore[attr-defined]
        config=BatcherConfig(max_running=32),
    )
    on = str(next(model.parameters()).device)
    seqs, engine_s = _decode(batcher, seed=0)
    tokens = sum(len(s.token_ids) for s in seqs)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    worst = _worst_logprob_diff(ref, seqs, device)
    with torch.no_grad():
        prompts = torch.tensor([list(range(3, 13))] * 32, device=device)
        start = time.perf_counter()
        out = ref.generate(prompts, max_new_tokens=64, min_new_tokens=64, do_sample=True)
        if device == "cuda":
            torch.cuda.synchronize()
        generate_s = time.perf_counter() - start
    generated = (out.shape[1] - prompts.shape[1]) * out.shape[0]
    # new weights from host memory, as a load brings them, then decode under them
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(1.01)
    new = {k: v.detach().cpu() for k, v in ref.state_dict().items()}
    worker = EngineWorker(batcher)
    worker.start()
    try:
        worker.load_weights(lambda: new, version=1, mode="drain").result(timeout=120)
    finally:
        worker.stop()
    after, _ = _decode(batcher, seed=1)
    worst_after = _worst_logprob_diff(ref, after, device)
    versions = {v for s in after for v in s.versions}
    ok = worst < 1e-3 and worst_after < 1e-3 and versions == {1} and on.startswith(device)
    print(
        f"engine: model on {on}; {tokens} tokens in {engine_s:.2f} s ({tokens / engine_s:.0f} "
        f"tok/s); model.generate on {device}: {generated / generate_s:.0f} tok/s; behaviour "
        f"logprobs vs a forward on {device}: max |diff| {worst:.2e}, after a weight load "
        f"{worst_after:.2e} (versions {sorted(versions)}) ({'ok' if ok else 'FAIL'})"
    )
    return ok


def _decode(batcher: object, *, seed: int) -> tuple[list[Any], float]:
    from dora.engine.batcher import Batcher
    from dora.protocol import SamplingParams

    assert isinstance(batcher, Batcher)
    seqs = [
        batcher.new_sequence(
            f"s{seed}r{i}", list(range(3, 13)), SamplingParams(max_tokens=64, seed=seed * 100 + i)
        )
        for i in range(32)
    ]
    start = time.perf_counter()
    batcher.add_all(seqs)
    while batcher.has_work():
        batcher.step()
    return seqs, time.perf_counter() - start


def _worst_logprob_diff(ref: Any, seqs: list[Any], device: str) -> float:
    import torch

    worst = 0.0
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s.prompt_ids + s.token_ids], device=device)
            logp = torch.log_softmax(ref(ids).logits[0].float(), -1)[len(s.prompt_ids) - 1 : -1]
            got = logp.gather(1, torch.tensor(s.token_ids, device=device)[:, None])[:, 0]
            worst = max(worst, float((got.cpu() - torch.tensor(s.logprobs)).abs().max()))
    return worst


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


def nccl_part(device: str, model_dir: Path) -> bool:
    """Trainer rank 0's broadcast of a published version (`dora.learn.nccl`) to two receivers
    that do what vLLM's unpacked receive does with serve's `/update_weights` body, over a gloo
    group of threads standing in for vLLM's NCCL one (its tensors on DEVICE); then whether the
    real group can be opened here, or why not."""
    import datetime
    import importlib.util
    import threading

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from dora.errors import ConfigError
    from dora.learn.nccl import broadcast_weights, open_communicator
    from dora.learn.publish import inline_chunks
    from dora.weight_transfer import TransferGroup, UpdateInfo

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    published = dict(model.state_dict())
    chunks = inline_chunks(published, version=1)
    body = UpdateInfo.of(
        [n for c in chunks for n in c.names],
        [d for c in chunks for d in c.dtypes],
        [s for c in chunks for s in c.shapes],
    ).body()["update_info"]
    assert isinstance(body, dict)
    group = TransferGroup(master_address="127.0.0.1", master_port=29500, instances=2)
    store = dist.HashStore()
    got: dict[int, object] = {}

    def rank(r: int) -> None:
        pg = dist.ProcessGroupGloo(store, r, group.world_size, datetime.timedelta(seconds=60))

        class Gloo:
            def broadcast(self, tensor: torch.Tensor, src: int) -> None:
                options = dist.BroadcastOptions()
                options.rootRank = src
                pg.broadcast([tensor], options).wait()

        try:
            if r == 0:
                got[r] = broadcast_weights(Gloo(), published, device=device)
                return
            received = {}
            for name, dtype, shape in zip(
                body["names"], body["dtype_names"], body["shapes"], strict=True
            ):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                Gloo().broadcast(tensor, src=0)
                received[name] = tensor
            got[r] = received
        except Exception as exc:  # reported below
            got[r] = exc

    start = time.perf_counter()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(group.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    seconds = time.perf_counter() - start
    same = all(
        isinstance(got.get(r), dict)
        and all(torch.equal(got[r][n], t) for n, t in published.items())  # type: ignore[index]
        for r in (1, 2)
    )
    nbytes = sum(t.numel() * t.element_size() for t in published.values())
    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        # opening it would wait for workers that are not there
        real = "vLLM importable and a GPU here: the group can open (checked only against vLLM)"
    else:
        try:
            open_communicator(TransferGroup(master_address="127.0.0.1", master_port=1, instances=1))
            real = "opened (unexpected)"
        except ConfigError as exc:
            real = f"refused where it cannot run: {exc}"
    received = "identical, in the order serve sends" if same else "DIFFERENT"
    print(
        f"nccl: rank 0 broadcast {len(published)} tensors ({nbytes / 2**20:.1f} MiB, bfloat16) "
        f"on {device} to 2 receivers over a gloo stand-in in {seconds:.2f} s: received "
        f"{received} ({'ok' if same else 'FAIL'})"
    )
    print(f"nccl: open_communicator here: {real}")
    if importlib.util.find_spec("vllm") is not None and torch.cuda.device_count() >= 2:
        print(
            "nccl: to exercise it end to end (vLLM servers on GPUs): dora run "
            "examples/math/gpu.toml learn.weight_transport=nccl rollout.mode=one_step_off, "
            "then nccl_loads and nccl_fallbacks in the run's summary.json"
        )
    return same


def run_part(device: str, scratch: Path) -> bool:
    config = str(REPO / "examples/math/config.toml")
    settings = [
        "learn.steps=4",
        "model.warmup_steps=20",
        "data.eval_size=0",
        "log.progress=false",
        f"log.run_dir={scratch / 'run'}",
        # one GPU: one engine, and the trainer beside it on the same GPU
        *(
            ["model.dtype=bfloat16", "serve.instances=1", "run.colocate=true"]
            if device == "cuda"
            else []
        ),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DORA_CACHE": str(scratch / "cache")}
    dora = [sys.executable, "-m", "dora.cli", "run", config, *settings]
    plan = subprocess.run([*dora, "--dry-run"], env=env, capture_output=True, text=True)
    placement = [line for line in plan.stdout.splitlines() if line.startswith(("placement", "  "))]
    print("\n".join(placement))
    # on a GPU the plan must put the engine and the trainer on it
    planned = device != "cuda" or sum(" on cuda" in line for line in placement) == 2
    start = time.perf_counter()
    done = subprocess.run(dora, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    ok = done.returncode == 0 and planned
    if not planned:
        print("run: FAIL: the plan does not put the engine and the trainer on the GPU")
    print(f"run: dora run of the math example, 4 steps: exit {done.returncode} in {wall:.0f} s")
    if not ok:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="every part on the CPU (no GPU needed)")
    p.add_argument("--parts", default="engine,trainer,nccl,run")
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
        if "nccl" in parts:
            results["nccl"] = nccl_part(device, model_dir)
        if "run" in parts:
            results["run"] = run_part(device, scratch)
    print("gpu-check: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
