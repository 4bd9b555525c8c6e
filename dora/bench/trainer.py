"""`dora bench trainer`: the trainer's compute per trained token, a group's prompt once per
micro-batch (`learn.shared_prefix`, the default) against one padded row per sequence, and a packed
row attended by segments (the trainer's default with SDPA attention) against the same row under
its dense mask.

The model is the config's (prepared as `dora learn` prepares it); each group is one of the
config's task prompts, as serve renders them, with `G` answers whose lengths are those of groups
sampled on this workload (the stored lengths of `python -m dora.bench.cpu`, or `--lengths`) and
whose tokens are random (the compute does not depend on them). Each round runs `--steps` trainer
steps of `B` groups padded, packed under the mask and packed by segments (the order reverses
between rounds), on the same groups, in one process with the same torch thread count, and prints
CPU-milliseconds per trained token, tokens the model ran per trained token, and the round's
ratios. A model whose attention is not SDPA has no segments: its packed rows run under the mask.

The last two lines are `mask/segments CPU per trained token: X.XX` and `padded/packed CPU per
trained token: X.XX` (medians of the rounds; packed is the trainer's own way).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dora.bench import summary

if TYPE_CHECKING:
    from dora.config import DoraConfig
    from dora.learn.batching import SequenceItem


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dora.bench.cpu_measure import task_prompts
    from dora.bench.training import train_step
    from dora.config import load_config
    from dora.costs.presets import CPU_BENCH_LENGTHS
    from dora.learn.segment_attention import NAME as SEGMENT_ATTENTION
    from dora.learn.segment_attention import use_segment_attention
    from dora.models.prepare import prepare_model
    from dora.sim.workload import read_lengths

    p = argparse.ArgumentParser(prog="dora bench trainer", description=summary(__doc__))
    p.add_argument("config", nargs="?", default="examples/math/bench.toml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--lengths", type=Path, default=CPU_BENCH_LENGTHS, help="groups' answer lengths")
    p.add_argument("--steps", type=int, default=6, help="trainer steps per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's)")
    args = p.parse_intermixed_args(argv)

    config = load_config(args.config, args.overrides)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    path = prepare_model(config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    segments = use_segment_attention(model)  # as the trainer's: padded rows are plain sdpa
    prompts = task_prompts(config, AutoTokenizer.from_pretrained(path))
    cap, g = config.rollout.max_tokens, config.rollout.group_size
    lines = read_lengths(str(args.lengths))
    answers = [[min(int(line[i % len(line)]), cap) for i in range(g)] for line in lines]
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learn.lr)
    steps = _batches(model, config, prompts, answers, steps=args.steps)
    b = config.rollout.batch_size
    train_step(model, optimizer, steps[0], config=config, packed=True)  # warm up
    print(
        f"{config.model.path}: {args.steps} steps of {b} groups x {config.rollout.group_size}, "
        f"learn.micro_batch_tokens {config.learn.micro_batch_tokens}, {args.threads} thread(s)"
    )
    print(f"{'round':>5} {'rows':>17} {'CPU-ms/trained':>15} {'run/trained':>12} {'s/step':>7}")
    variants = [("padded", False, None), ("packed", True, SEGMENT_ATTENTION if segments else None)]
    if segments:
        variants.insert(1, ("packed under mask", True, "sdpa"))
    ratios: dict[str, list[float]] = {"padded/packed": [], "mask/segments": []}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        cost = _round(r, order, model, optimizer, steps, config=config)
        ratios["padded/packed"].append(cost["padded"] / cost["packed"])
        line = f"round {r}: padded/packed {ratios['padded/packed'][-1]:.2f}"
        if segments:
            ratios["mask/segments"].append(cost["packed under mask"] / cost["packed"])
            line += f", mask/segments {ratios['mask/segments'][-1]:.2f}"
        print(line)
    if segments:
        median = statistics.median(ratios["mask/segments"])
        print(f"mask/segments CPU per trained token: {median:.2f}")
    print(f"padded/packed CPU per trained token: {statistics.median(ratios['padded/packed']):.2f}")
    return 0


def _batches(
    model: Any,
    config: DoraConfig,
    prompts: list[list[int]],
    answers: list[list[int]],
    *,
    steps: int,
) -> list[list[list[SequenceItem]]]:
    """`steps` steps of `B` groups: the task prompts' lengths and the answers' lengths in turn,
    random tokens."""
    from dora.bench.training import synthetic_group

    vocab = int(model.get_output_embeddings().weight.shape[0])
    rng = np.random.default_rng(0)
    b = config.rollout.batch_size
    return [
        [
            synthetic_group(
                rng,
                vocab=vocab,
                prompt=len(prompts[(s * b + i) % len(prompts)]),
                answers=answers[(s * b + i) % len(answers)],
                gid=f"g{s * b + i}",
            )
            for i in range(b)
        ]
        for s in range(steps)
    ]


def _round(
    r: int,
    variants: list[tuple[str, bool, str | None]],
    model: Any,
    optimizer: Any,
    steps: list[list[list[SequenceItem]]],
    *,
    config: DoraConfig,
) -> dict[str, float]:
    """One round: every variant over the same steps; CPU-milliseconds per trained token of each."""
    from dora.bench.training import train_step

    cost: dict[str, float] = {}
    for name, packed, attention in variants:
        if attention is not None:
            model.set_attn_implementation(attention)
        cpu, wall = time.process_time(), time.perf_counter()
        trained = run = 0
        for groups in steps:
            done = train_step(model, optimizer, groups, config=config, packed=packed)
            trained += done.trained
            run += done.run
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        cost[name] = 1e3 * cpu / trained
        print(
            f"{r:>5} {name:>17} {cost[name]:>15.3f} {run / trained:>12.2f} "
            f"{wall / len(steps):>7.3f}"
        )
    return cost


if __name__ == "__main__":
    raise SystemExit(main())
