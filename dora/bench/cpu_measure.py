"""The CPU calibration's measurement: the costs of a dora config's tiny model on this machine.

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
  prompt tokens and its answers (`dora.bench.training`), packed as the trainer packs them
  (`learn.micro_batch_tokens`, `learn.shared_prefix`), forward + the policy loss + backward, one
  AdamW step; at one thread and at every core; seconds per (prompt or answer) token and per step
  fitted over the steps;
- *weight sync*: the inline transport's chunks of the state dict, encoded, decoded and loaded.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from dora.bench.cpu_costs import Costs, fit_decode, fit_linear, group_share, lognormal
from dora.config import DoraConfig

__all__ = ["measure", "task_prompts"]

_PROMPTS = 192


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
    prompt_median, prompt_sigma = lognormal([len(p) for p in prompts])
    response_median, response_sigma = lognormal([float(n) for n in responses])
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
        group_share=group_share(groups),
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

    from dora.bench.training import synthetic_group, train_step
    from dora.learn.segment_attention import use_segment_attention

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
