"""Supervised warm-up: teach a model from scratch the format of a task before RL.

RL needs a policy that sometimes succeeds: a randomly initialised model never writes `#### 42`, so
every reward is 0, every group-normalised advantage is 0, and nothing is learnt. The examples build
their own tiny model and give it a short supervised warm-up on reference completions (each task's
`answer` field, e.g. chain arithmetic's worked solution), which leaves it at a modest accuracy that
RL then raises. This is ordinary next-token cross-entropy on the completion tokens only, rendered
exactly as the rollout renders prompts (the environment's `reset` and the chat template), so the
warm-up and the RL episodes see the same token sequences.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dora.env import Env, Task


@dataclass(frozen=True, kw_only=True)
class WarmupSettings:
    steps: int
    lr: float = 3e-3
    batch_size: int = 32
    max_len: int = 512
    seed: int = 0
    threads: int = 2


def render_example(tokenizer: object, env: Env, task: Task) -> tuple[list[int], list[int]] | None:
    """(prompt ids, completion ids) for one task, or None when the task has no reference answer."""
    answer = task.data.get("answer")
    if not isinstance(answer, str):
        return None
    prompt = env.reset(task)
    if asyncio.iscoroutine(prompt):
        prompt.close()
        raise TypeError("warm-up needs an environment whose reset() is synchronous")
    if isinstance(prompt, str):
        prompt_ids: list[int] = tokenizer.encode(prompt, add_special_tokens=False)  # type: ignore[attr-defined]
    else:
        prompt_ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    completion = tokenizer.encode(answer, add_special_tokens=False)  # type: ignore[attr-defined]
    return list(prompt_ids), [*completion, tokenizer.eos_token_id]  # type: ignore[attr-defined]


def warmup(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    tasks: Sequence[Task],
    env_factory: Callable[[], Env],
    settings: WarmupSettings,
    progress: Callable[[int, float], None] | None = None,
) -> Path:
    """Fine-tune `model_dir` on the tasks' reference answers; save the result to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples = []
    for task in tasks:
        pair = render_example(tokenizer, env_factory(), task)
        if pair is not None and len(pair[0]) + len(pair[1]) <= settings.max_len:
            examples.append(pair)
    if not examples:
        raise ValueError("warm-up found no task with a reference `answer` that fits max_len")
    rng = random.Random(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    warm = max(1, settings.steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < warm:
            return (step + 1) / warm
        frac = (step - warm) / max(1, settings.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    pad = tokenizer.pad_token_id
    model.train()
    for step in range(settings.steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(settings.batch_size)]
        width = max(len(p) + len(c) for p, c in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, c) in enumerate(batch):
            seq = p + c
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, len(p) : len(seq)] = torch.tensor(c)
            attention[row, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if progress is not None:
            progress(step, loss.item())
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
