"""`dora bench trainer`: the trainer's compute per trained token, a group's prompt once per
micro-batch (`learn.shared_prefix`, the default) against one padded row per sequence.

The model is the config's (prepared as `dora learn` prepares it); each group is one of the
config's task prompts, as serve renders them, with `G` answers whose lengths are those of groups
sampled on this workload (the stored lengths of `python -m dora.sim.cpu`, or `--lengths`) and
whose tokens are random (the compute does not depend on them). Each round runs `--steps` trainer
steps of `B` groups padded, then packed (the order alternates between rounds), on the same groups,
in one process with the same torch thread count, and prints CPU-milliseconds per trained token,
tokens the model ran per trained token, and the padded/packed ratio within the round.

The last line is `padded/packed CPU per trained token: X.XX` (the median of the rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dora.config import load_config
    from dora.models.prepare import prepare_model
    from dora.sim.cpu import BENCH_LENGTHS, task_prompts
    from dora.sim.training import synthetic_group, train_step
    from dora.sim.workload import read_lengths

    p = argparse.ArgumentParser(prog="dora bench trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="examples/math/bench.toml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--lengths", type=Path, default=BENCH_LENGTHS, help="groups' answer lengths")
    p.add_argument("--steps", type=int, default=6, help="trainer steps per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's)")
    args = p.parse_intermixed_args(argv)

    config = load_config(args.config, args.overrides)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    path = prepare_model(config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    prompts = task_prompts(config, AutoTokenizer.from_pretrained(path))
    cap, g = config.rollout.max_tokens, config.rollout.group_size
    lines = read_lengths(str(args.lengths))
    answers = [[min(int(line[i % len(line)]), cap) for i in range(g)] for line in lines]
    vocab = int(model.get_output_embeddings().weight.shape[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learn.lr)
    rng = np.random.default_rng(0)
    b = config.rollout.batch_size
    steps = [
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
        for s in range(args.steps)
    ]
    train_step(model, optimizer, steps[0], config=config, packed=True)  # warm up
    print(
        f"{config.model.path}: {args.steps} steps of {b} groups x {config.rollout.group_size}, "
        f"learn.micro_batch_tokens {config.learn.micro_batch_tokens}, {args.threads} thread(s)"
    )
    print(f"{'round':>5} {'rows':>7} {'CPU-ms/trained':>15} {'run/trained':>12} {'s/step':>7}")
    ratios = []
    for r in range(args.rounds):
        cost: dict[bool, float] = {}
        for packed in (False, True) if r % 2 == 0 else (True, False):
            cpu, wall = time.process_time(), time.perf_counter()
            trained = run = 0
            for groups in steps:
                done = train_step(model, optimizer, groups, config=config, packed=packed)
                trained += done.trained
                run += done.run
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            cost[packed] = 1e3 * cpu / trained
            print(
                f"{r:>5} {'packed' if packed else 'padded':>7} {cost[packed]:>15.3f} "
                f"{run / trained:>12.2f} {wall / len(steps):>7.3f}"
            )
        ratios.append(cost[False] / cost[True])
        print(f"round {r}: padded/packed {ratios[-1]:.2f}")
    print(f"padded/packed CPU per trained token: {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
