"""Calibrate the simulator on this machine for the tiny model of a dora config, and predict the
modes of `dora bench modes` for that config.

    python -m dora.sim.cpu examples/math/bench.toml       # measure, fit, predict (~1.2 min)
    dora simulate --preset cpu-bench                        # the same prediction, from the
                                                            # stored constants (BENCH_COSTS)

Everything is measured in this process on the config's prepared model (the one the benchmark
runs), with nothing taken from a benchmark run, so every mode's numbers are predictions:

- *decode*: one torch thread (each instance has one in the benchmark); `b` = 1, 2, 4, ...
  `serve.max_running` sequences decoding together from the workload's prompts, every engine step
  timed; `t = t0 + c*b + k*S` fitted by least squares (`S`: context tokens of the running rows);
- *prefill*: `G` prompts prefilled together, seconds per prompt token;
- *lengths*: `G` samples of each of 192 prompts at the config's temperature and `max_tokens`,
  written one group per line to a lengths file (`--lengths-out`) that the simulator draws groups
  from: a log-normal fit misses this workload's tail (its mean answer was 40% short of the
  measured one, so the synchronous rollout's tail was predicted short); the median and log-normal
  sigma of prompt and response lengths and the share of the log-length variance a group's samples
  have in common are printed with the costs;
- *training*: `B` groups of those lengths per step, each one prompt's length of shared random
  prompt tokens and its answers (`dora.sim.training`), packed as the trainer packs them
  (`learn.micro_batch_tokens`, `learn.shared_prefix`), forward + the policy loss + backward, one
  AdamW step; at one thread and at every core; seconds per (prompt or answer) token and per step
  fitted over the steps;
- *weight sync*: the inline transport's chunks of the state dict, encoded, decoded and loaded.

It also prints the best serve side one core can give this workload: every measured group decoded
by one engine with continuous batching (`serve.max_running` rows), the fitted decode and prefill
costs replayed step by step. Under the split placement serve runs on one core, so no asynchronous
mode placed so can beat that rate, however well it schedules.

The prediction is of the split placement (`dora bench modes --placement split`), because the cost
model gives rollout and training disjoint pools; the benchmark's default for the asynchronous modes
is `shared` (dora/placement.py: serve, its instances and the trainer unpinned on every core at
once), which the model does not represent. On the cost model a GPU is a core: `gpus` = the cores
this process may use, `rollout_gpus` = the cores the split placement pins serve to (the rest
train), `gpus_per_instance` = threads per instance, `pool_instances` = `serve.instances`, and
`shared_cores` on (the instances are processes time-slicing their cores). The decode
coefficients are mapped onto the model's formulas (weight read and KV read at the fitted
bandwidth, `decode_overhead_ms` the rest of `t0`). The simulator counts prompt and response tokens
as trained tokens; the benchmark counts loss (response) tokens only, so compare ratios, not
tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dora.config import DoraConfig, load_config
from dora.sim.costs import Setup, validate

__all__ = [
    "Costs",
    "fit_decode",
    "fit_linear",
    "measure",
    "one_core_serve",
    "setup_for",
    "task_prompts",
    "write_lengths",
]

_PROMPTS = 192
_NOMINAL_TFLOPS = 1.0  # the cost model's unit of compute; the fitted efficiencies absorb it


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What was measured (seconds unless named otherwise)."""

    decode_t0_s: float
    decode_c_s: float
    decode_k_s: float
    prefill_s_per_token: float
    train_s_per_token: float
    """One thread."""
    train_step_s: float
    train_speedup: float
    """Training at every core over one thread."""
    weight_sync_s: float
    prompt_median: float
    prompt_sigma: float
    prompt_max: int
    response_median: float
    response_sigma: float
    group_share: float
    response_mean: float
    response_max: int
    params: int
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    cores: int


def fit_linear(x: list[list[float]], y: list[float]) -> list[float]:
    """Least-squares coefficients of `y ~ x` (rows of regressors), negatives clipped to 0."""
    coef, *_ = np.linalg.lstsq(np.asarray(x, dtype=float), np.asarray(y, dtype=float), rcond=None)
    return [max(0.0, float(v)) for v in coef]


def fit_decode(samples: list[tuple[int, float, float]]) -> tuple[float, float, float]:
    """`(t0, c, k)` of `t = t0 + c*b + k*S` from `(b, S, seconds)` samples."""
    t0, c, k = fit_linear([[1.0, b, s] for b, s, _ in samples], [t for _, _, t in samples])
    return t0, c, k


def _lognormal(values: list[float]) -> tuple[float, float]:
    logs = [math.log(max(1.0, v)) for v in values]
    return math.exp(statistics.median(logs)), statistics.pstdev(logs)


def _group_share(groups: list[list[int]]) -> float:
    """Share of the variance of log-lengths that lies between groups (one-way decomposition)."""
    logs = [[math.log(max(1, n)) for n in g] for g in groups if len(g) > 1]
    every = [v for g in logs for v in g]
    total = statistics.pvariance(every)
    within = statistics.fmean(statistics.pvariance(g) for g in logs)
    return 0.0 if total <= 0 else min(1.0, max(0.0, 1.0 - within / total))


def measure(config: DoraConfig, *, log: bool = True) -> tuple[Costs, list[tuple[int, list[int]]]]:
    """Measure the costs of `config`'s tiny model on this machine (see the module docstring);
    also return the sampled groups as `(prompt tokens, response lengths)`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dora.models.prepare import prepare_model

    def say(text: str) -> None:
        if log:
            print(text, flush=True)

    path = prepare_model(config, log=log)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = task_prompts(config, tok)
    r = config.rollout
    with torch.no_grad():
        groups = _sample(model, tok, config, prompts)
        say(f"lengths: {sum(len(g) for g in groups)} samples of {len(groups)} prompts")
        decode = _time_decode(model, tok, config, prompts)
        t0, c, k = fit_decode(decode)
        say(f"decode: t0 {1e3 * t0:.3f} ms, c {1e3 * c:.4f} ms/seq, k {1e6 * k:.4f} us/token")
        prefill = _time_prefill(model, tok, prompts, r.group_size)
        say(f"prefill: {1e6 * prefill:.1f} us per prompt token")
    sync_s = _time_weight_sync(model)
    say(f"weight sync: {1e3 * sync_s:.1f} ms")
    responses = [n for g in groups for n in g]
    sampled = [(len(prompts[i % len(prompts)]), g) for i, g in enumerate(groups)]
    cores = len(os.sched_getaffinity(0))
    per_token, per_step = _time_training(path, config, sampled, threads=1)
    per_token_all, per_step_all = _time_training(path, config, sampled, threads=cores)
    tokens = statistics.fmean(sum(p + n for n in g) for p, g in sampled) * r.batch_size
    one = per_token * tokens + per_step
    speedup = one / max(1e-9, per_token_all * tokens + per_step_all)
    say(
        f"training: {1e3 * per_token:.3f} ms/token + {1e3 * per_step:.1f} ms/step at 1 thread;"
        f" {speedup:.2f}x at {cores} threads"
    )
    prompt_median, prompt_sigma = _lognormal([len(p) for p in prompts])
    response_median, response_sigma = _lognormal([float(n) for n in responses])
    hf: Any = model.config
    heads = int(hf.num_attention_heads)
    return Costs(
        decode_t0_s=t0,
        decode_c_s=c,
        decode_k_s=k,
        prefill_s_per_token=prefill,
        train_s_per_token=per_token,
        train_step_s=per_step,
        train_speedup=speedup,
        weight_sync_s=sync_s,
        prompt_median=prompt_median,
        prompt_sigma=prompt_sigma,
        prompt_max=max(len(p) for p in prompts),
        response_median=response_median,
        response_sigma=response_sigma,
        group_share=_group_share(groups),
        response_mean=statistics.fmean(responses),
        response_max=r.max_tokens,
        params=sum(p.numel() for p in model.parameters()),
        layers=int(hf.num_hidden_layers),
        hidden=int(hf.hidden_size),
        kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
        cores=cores,
    ), sampled


def task_prompts(config: DoraConfig, tok: Any) -> list[list[int]]:
    """The token ids of the first tasks' prompts, rendered as serve renders them."""
    from dora.data import config_tasks
    from dora.env import load_env

    env_factory = load_env(config.env.cls, **config.env.kwargs)
    tasks = config_tasks(config.data, env_factory)
    out = []
    for task in tasks[:_PROMPTS]:
        prompt = env_factory().reset(task)
        if isinstance(prompt, str):
            out.append(list(tok.encode(prompt, add_special_tokens=False)))
        else:
            ids = tok.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            out.append(list(ids))
    return out


def _batcher(model: Any, tok: Any, max_running: int) -> Any:
    from dora.engine.batcher import Batcher, BatcherConfig

    return Batcher(
        model,
        eos_token_ids=[tok.eos_token_id],
        decode=tok.decode,
        config=BatcherConfig(max_running=max_running),
    )


def _sample(model: Any, tok: Any, config: DoraConfig, prompts: list[list[int]]) -> list[list[int]]:
    """Response lengths of `G` samples per prompt, as the rollout samples them."""
    from dora.protocol import SamplingParams

    r = config.rollout
    batcher = _batcher(model, tok, config.serve.max_running)
    seqs = []
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=i)
        for j in range(r.group_size):
            seq = batcher.new_sequence(f"p{i}-{j}", ids, params, index=j)
            seqs.append(seq)
            batcher.add(seq)
    while batcher.has_work():
        batcher.step()
    return [
        [len(s.token_ids) for s in seqs[i * r.group_size : (i + 1) * r.group_size]]
        for i in range(len(prompts))
    ]


def _time_decode(
    model: Any, tok: Any, config: DoraConfig, prompts: list[list[int]]
) -> list[tuple[int, float, float]]:
    """`(b, S, seconds)` of decode steps at batch sizes 1, 2, 4, ... max_running."""
    from dora.protocol import SamplingParams

    out = []
    b = 1
    sizes = []
    while b <= config.serve.max_running:
        sizes.append(b)
        b *= 2
    for b in sizes:
        batcher = _batcher(model, tok, b)
        params = SamplingParams(max_tokens=96, temperature=1.0, ignore_eos=True, seed=b)
        for i in range(b):
            batcher.add(batcher.new_sequence(f"d{i}", prompts[i % len(prompts)], params))
        batcher.step()  # admission and prefill, then the first decode
        while batcher.has_work():
            context = sum(len(s.prompt_ids) + len(s.token_ids) for s in batcher.running)
            start = time.perf_counter()
            batcher.step()
            out.append((b, float(context), time.perf_counter() - start))
    return out


def _time_prefill(model: Any, tok: Any, prompts: list[list[int]], group_size: int) -> float:
    """Seconds per prompt token of prefilling `group_size` copies of a prompt together."""
    from dora.protocol import SamplingParams

    per_token = []
    for ids in prompts[:16]:
        batcher = _batcher(model, tok, group_size)
        params = SamplingParams(max_tokens=1, temperature=1.0, ignore_eos=True)
        for j in range(group_size):
            batcher.add(batcher.new_sequence(f"f{j}", ids, params, index=j))
        start = time.perf_counter()
        batcher.step()  # prefill + the one token
        per_token.append((time.perf_counter() - start) / (len(ids) * group_size))
    return statistics.median(per_token)


def _time_weight_sync(model: Any) -> float:
    import msgspec

    from dora.learn.publish import inline_chunks, state_dict_from_chunks
    from dora.protocol import WeightChunk

    times = []
    for version in range(1, 6):
        start = time.perf_counter()
        wire = [msgspec.msgpack.encode(c) for c in inline_chunks(model.state_dict(), version=1)]
        chunks = [msgspec.msgpack.decode(b, type=WeightChunk) for b in wire]
        model.load_state_dict(state_dict_from_chunks(chunks))
        times.append(time.perf_counter() - start)
        del version
    return statistics.median(times)


def _time_training(
    path: Path, config: DoraConfig, groups: list[tuple[int, list[int]]], *, threads: int
) -> tuple[float, float]:
    """`(seconds per token, seconds per step)` of the trainer's compute on these groups
    (`(prompt tokens, response lengths)`); a token is a prompt or a response token of a sample."""
    import torch
    from transformers import AutoModelForCausalLM

    from dora.learn.segment_attention import use_segment_attention
    from dora.sim.training import synthetic_group, train_step

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    use_segment_attention(model)  # as the trainer's: padded rows are plain sdpa, packed ones not
    vocab = int(model.get_output_embeddings().weight.shape[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learn.lr)
    rng = np.random.default_rng(0)
    b = config.rollout.batch_size
    steps = []
    for step in range(max(6, 2 * len(groups) // b)):
        chosen = [groups[(step * b + i) % len(groups)] for i in range(b)]
        batch = [
            synthetic_group(rng, vocab=vocab, prompt=prompt, answers=answers, gid=f"g{g}")
            for g, (prompt, answers) in enumerate(chosen)
        ]
        start = time.perf_counter()
        train_step(model, optimizer, batch, config=config, packed=config.learn.shared_prefix)
        tokens = sum(prompt + n for prompt, answers in chosen for n in answers)
        steps.append((float(tokens), time.perf_counter() - start))
    torch.set_num_threads(1)
    sizes, seconds = [t for t, _ in steps[1:]], [s for _, s in steps[1:]]
    per_token, per_step = fit_linear([[t, 1.0] for t in sizes], seconds)
    if per_step == 0.0:
        # the fit wanted a negative overhead: a step's cost grows faster than its tokens (attention
        # over long rows), and the clipped fit's slope would overstate the cost of a mean step
        per_token = sum(seconds) / sum(sizes)
    return per_token, per_step


def write_lengths(path: Path, groups: list[tuple[int, list[int]]]) -> Path:
    """A lengths file of the sampled groups, one group's response lengths per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# response lengths of one group per line (python -m dora.sim.cpu)"]
    lines += [" ".join(map(str, g)) for _, g in groups]
    path.write_text("\n".join(lines) + "\n")
    return path


def one_core_serve(costs: Costs, groups: list[tuple[int, list[int]]], *, max_running: int) -> float:
    """Seconds per response token when one engine on one core decodes every group: all queued at
    once, continuous batching over `max_running` rows, each step costing the fitted
    `t0 + c*b + k*S` and each admitted prompt its prefill (pure)."""
    waiting = [(p, n) for p, g in groups for n in g]
    waiting.reverse()
    running: list[list[int]] = []  # [tokens left, context]
    seconds = 0.0
    tokens = 0
    while waiting or running:
        while waiting and len(running) < max_running:
            prompt, n = waiting.pop()
            seconds += prompt * costs.prefill_s_per_token
            running.append([n, prompt])
        b = len(running)
        seconds += costs.decode_t0_s + costs.decode_c_s * b
        seconds += costs.decode_k_s * sum(ctx for _, ctx in running)
        tokens += b
        for row in running:
            row[0] -= 1
            row[1] += 1
        running = [row for row in running if row[0] > 0]
    return seconds / max(1, tokens)


def setup_for(
    config: DoraConfig,
    costs: Costs,
    *,
    trainer_cores: int | None = None,
    lengths_file: str | Path = "",
) -> Setup:
    """The cost model of `dora bench modes CONFIG --placement split` on this machine (see the
    module docstring); `lengths_file` (from `write_lengths`) gives the measured groups' response
    lengths."""
    serve_cores = costs.cores - (trainer_cores or max(1, costs.cores // 2))
    tp = config.serve.threads_per_instance
    params_b = costs.params / 1e9
    kv_bytes = 2.0 * costs.layers * costs.kv_heads * costs.head_dim * 2.0  # the model's formula
    bandwidth = kv_bytes / tp / costs.decode_k_s if costs.decode_k_s > 0 else 1e15
    weight_read_s = params_b * 2e9 / tp / bandwidth
    c = max(costs.decode_c_s, 1e-9)
    kv_tokens = config.serve.max_running * config.model.max_model_len
    weights_gb = params_b * 2.0 / tp
    r, learn = config.rollout, config.learn
    prompt = max(1, round(costs.prompt_median))  # prefill matches the measurement at this length
    prefill_flops = 2.0 * params_b * 1e9 * prompt + 2.0 * costs.layers * costs.hidden * prompt**2
    setup = Setup(
        name="cpu-bench",
        gpus=costs.cores,
        groups_per_step=r.batch_size,
        group_size=r.group_size,
        staleness=r.staleness,
        steps=learn.steps,
        warmup_steps=1,  # the benchmark's window starts at the first trained step
        prompt_median=prompt,
        prompt_sigma=costs.prompt_sigma,
        prompt_max=costs.prompt_max,
        response_median=max(1, round(costs.response_median)),
        response_sigma=costs.response_sigma,
        response_max=costs.response_max,
        group_share=costs.group_share,
        params_b=params_b,
        layers=costs.layers,
        hidden=costs.hidden,
        kv_heads=costs.kv_heads,
        head_dim=costs.head_dim,
        gpu_mem_gb=weights_gb + kv_tokens * kv_bytes / 1e9 / tp,
        hbm_tbps=bandwidth / 1e12,
        gpu_tflops=_NOMINAL_TFLOPS,
        hbm_efficiency=1.0,
        decode_mfu=2.0 * params_b * 1e9 / tp / (c * _NOMINAL_TFLOPS * 1e12),
        prefill_mfu=prefill_flops / (tp * prompt * costs.prefill_s_per_token * 1e12),
        mem_utilization=1.0,
        activation_gb=0.0,
        gpus_per_instance=tp,
        rollout_gpus=serve_cores,
        max_seqs=config.serve.max_running,
        kv_watermark=0.0,
        weight_sync_s=costs.weight_sync_s,
        kv_transfer_gbps=1.0,
        migrate_kv=config.serve.kv_migration,
        partial_colocated=False,  # as `--placement split` runs partial, and dora
        pool_instances=config.serve.instances,
        shared_cores=True,
        train_parallel_efficiency=min(1.0, max(0.0, (costs.train_speedup - 1) / (costs.cores - 1))),
        decode_overhead_ms=1e3 * max(0.0, costs.decode_t0_s - weight_read_s),
        train_gpu_s_per_token=costs.train_s_per_token,
        train_step_overhead_s=costs.train_step_s,
        lengths_file=str(lengths_file),
    )
    validate(setup)
    return setup


BENCH_SETTINGS = (
    "model.max_model_len=768",
    "serve.instances=4",
    "serve.max_running=64",
    "rollout.staleness=3",
    "rollout.group_size=8",
    "rollout.batch_size=4",
    "rollout.max_tokens=512",
    "learn.steps=20",
)
"""The settings of examples/math/bench.toml that shape the cost model (a test keeps them equal)."""

BENCH_COSTS = Costs(
    decode_t0_s=0.0009205619098392255,
    decode_c_s=7.229364000819194e-05,
    decode_k_s=1.1299961196786009e-07,
    prefill_s_per_token=1.997556802277619e-05,
    train_s_per_token=8.857245849186017e-05,
    train_step_s=0.0,
    train_speedup=1.0827192954740923,
    weight_sync_s=0.0016610029997536913,
    prompt_median=94.0,
    prompt_sigma=0.09073789412504636,
    prompt_max=166,
    response_median=18.999999999999996,
    response_sigma=0.6385161806764883,
    group_share=0.6494899126132465,
    response_mean=36.692057291666664,
    response_max=512,
    params=538624,
    layers=2,
    hidden=128,
    kv_heads=4,
    head_dim=32,
    cores=2,
)
"""`python -m dora.sim.cpu examples/math/bench.toml` on the 2-core machine at load average 1.5-2.5
(docs/simulator.md has the run and its numbers)."""


BENCH_LENGTHS = Path(__file__).with_name("cpu_bench_lengths.txt")
"""The groups sampled in the same measurement (`--lengths-out`)."""


def bench_preset() -> Setup:
    """The `cpu-bench` preset: the benchmark's setup with the costs measured above."""
    return setup_for(
        load_config(None, list(BENCH_SETTINGS)), BENCH_COSTS, lengths_file=BENCH_LENGTHS
    )


def overrides(setup: Setup, base: Setup) -> list[str]:
    """`key=value` for every field of `setup` that differs from `base`."""
    out = []
    for f in dataclasses.fields(Setup):
        value = getattr(setup, f.name)
        if f.name != "name" and value != getattr(base, f.name):
            out.append(f"{f.name}={value:.6g}" if isinstance(value, float) else f"{f.name}={value}")
    return out


def main(argv: list[str] | None = None) -> int:
    from dora.sim.cli import run_modes
    from dora.sim.costs import preset
    from dora.sim.report import render, summarize

    p = argparse.ArgumentParser(prog="python -m dora.sim.cpu", description=__doc__.split("\n")[0])
    p.add_argument("config", help="the config of `dora bench modes`, e.g. examples/math/bench.toml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lengths-out",
        type=Path,
        default=Path("runs/sim-cpu-lengths.txt"),
        help="where to write the sampled groups' lengths (default: %(default)s)",
    )
    args = p.parse_intermixed_args(argv)
    # as `dora bench modes` runs every process: a 2-thread trainer spins at each OpenMP barrier
    # otherwise, and measured 10x slower than 1 thread on a loaded machine (docs/trainer.md)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    config = load_config(args.config, args.overrides)
    costs, groups = measure(config)
    lengths = write_lengths(args.lengths_out, groups)
    setup = setup_for(config, costs, lengths_file=lengths)
    print(f"\nmeasured: {costs}")
    print(f"sampled groups: {lengths}")
    serve_s = one_core_serve(costs, groups, max_running=config.serve.max_running)
    print(
        f"best serve side on one core (every group batched on one engine): "
        f"{1e3 * serve_s:.3f} ms per response token, {1 / serve_s:,.0f} tokens/s"
    )
    changed = overrides(setup, preset("cpu-bench"))
    print("\nthe same setup: dora simulate --preset cpu-bench " + " ".join(changed))
    modes = ["sync", "one_step_off", "partial", "dora"]
    summaries = [summarize(run) for run, _ in run_modes(setup, modes, seed=args.seed)]
    print(render(summaries, title=f"{setup.name} (predicted for {args.config})"), end="")
    by = {s["mode"]: s["tokens_per_s"] for s in summaries}
    for base in ("one_step_off", "partial", "sync"):
        print(f"dora/{base} throughput ratio: {by['dora'] / by[base]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
