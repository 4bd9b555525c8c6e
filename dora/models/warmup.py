"""Supervised warm-up: teach a model from scratch the format of a task before RL.

RL needs a policy that sometimes succeeds: a randomly initialised model never writes `#### 42` or a
well-formed tool call, so every reward is 0, every group-normalised advantage is 0, and nothing is
learnt. The examples build their own tiny model and give it a short supervised warm-up on reference
behaviour, which leaves it at a modest skill that RL then raises. This is ordinary next-token
cross-entropy on the policy's own tokens only, on token sequences built exactly as the episode
runner builds them, so the warm-up and the RL episodes see the same tokens. A task's reference is
one of:

- the environment's `demonstration(task)` (multi-turn tasks): the messages that follow `reset`'s
  prompt in a good episode. The sequence is the prompt rendered with the tool schemas
  (`ChatRenderer.prompt_ids`), then for each assistant turn the text the chat template writes for it
  (content, tool calls in the template's format) up to and including the end-of-turn token, which
  is what the model must sample, trained; the rest of the template's turn end and every other
  message (tool results, user replies, rendered as `ChatRenderer.new_message_ids` renders them)
  are context, not trained.
- otherwise the task's `answer` field (single-turn tasks, e.g. chain arithmetic's worked
  solution): the prompt, then the answer and the end-of-sequence token, trained.

An example is a list of segments (token ids, trained or not); the loss covers the trained ones.

Shared prefix: a multi-turn environment's transcripts open with the same long system prompt (tau2's
mock domain: the policy and the tool schemas, about 2,250 of its 2,600 tokens) and train on a few
hundred tokens after it. When the rows of a batch share at least `SHARED_PREFIX_MIN` leading
untrained tokens, that prefix is run once and its KV cache repeated over the rows, which gives the
same loss and gradients (to float rounding) at a fraction of the cost. Shorter shared prefixes
(single-turn prompts such as chain arithmetic's, whose rows share a few dozen tokens) keep plain
batches.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dora.env import Env, Message, Task, call_maybe_async
from dora.errors import ChatTemplateMissing, EnvError
from dora.tools import ToolBox

if TYPE_CHECKING:
    import torch

    from dora.episode import ChatRenderer

Segment = tuple[list[int], bool]
"""Token ids, and whether the loss covers them."""

SHARED_PREFIX_MIN = 512
"""Leading tokens a batch's rows must share before the prefix is computed once for all of them."""


@dataclass(frozen=True, kw_only=True)
class WarmupSettings:
    steps: int
    lr: float = 3e-3
    batch_size: int = 32
    max_len: int = 512
    seed: int = 0
    threads: int = 2
    add_special_tokens: bool = True
    """Plain-text prompts as `tokenizer(prompt)` gives them, special tokens included (as in RL)."""


def render_examples(
    tokenizer: object,
    env_factory: Callable[[], Env],
    tasks: Sequence[Task],
    *,
    add_special_tokens: bool = True,
) -> list[list[Segment] | None]:
    """The warm-up sequence of each task as segments, or None where a task has no reference (see
    the module doc). Runs each task's env hooks (they may be async) on a fresh env object, and
    closes it."""
    from dora.episode import ChatRenderer

    renderers: list[ChatRenderer] = []

    def renderer() -> ChatRenderer:  # only demonstrations need one (and a chat template)
        if not renderers:
            renderers.append(ChatRenderer(tokenizer))  # type: ignore[arg-type]
        return renderers[0]

    async def render_all() -> list[list[Segment] | None]:
        return [
            await _render_example(tokenizer, renderer, env_factory(), task, add_special_tokens)
            for task in tasks
        ]

    return asyncio.run(render_all())


async def _render_example(
    tokenizer: object,
    renderer: Callable[[], ChatRenderer],
    env: Env,
    task: Task,
    add_special_tokens: bool,
) -> list[Segment] | None:
    """One task's example. An environment that fails here (a hook that raises, or returns what
    cannot be rendered) is an EnvError naming the environment, the task and what failed: the
    warm-up has no policy for a broken environment, but the user must learn which one it is."""
    try:
        return await _render_hooks(tokenizer, renderer, env, task, add_special_tokens)
    except ChatTemplateMissing:
        raise  # a property of the model, not of this environment: its own error says so
    except Exception as exc:
        name = f"{type(env).__module__}.{type(env).__qualname__}"
        raise EnvError(
            f"warm-up: environment {name} failed on task {task.prompt_id!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    finally:
        await env.close()


async def _render_hooks(
    tokenizer: object,
    renderer: Callable[[], ChatRenderer],
    env: Env,
    task: Task,
    add_special_tokens: bool,
) -> list[Segment] | None:
    prompt = await call_maybe_async(env.reset, task)
    demonstration = await call_maybe_async(env.demonstration, task)
    if demonstration is not None:
        if not isinstance(prompt, list):
            raise TypeError(f"task {task.prompt_id!r}: a demonstration needs a chat prompt")
        toolbox = ToolBox(await call_maybe_async(env.tools))  # only the schemas are needed
        return _transcript(renderer(), prompt, toolbox, demonstration)
    answer = task.data.get("answer")
    if not isinstance(answer, str):
        return None
    if isinstance(prompt, str):
        prompt_ids: list[int] = tokenizer(prompt, add_special_tokens=add_special_tokens)[  # type: ignore[operator]
            "input_ids"
        ]
    else:
        prompt_ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    completion = tokenizer.encode(answer, add_special_tokens=False)  # type: ignore[attr-defined]
    return [(list(prompt_ids), False), ([*completion, tokenizer.eos_token_id], True)]  # type: ignore[attr-defined]


def batch_loss(
    model: torch.nn.Module,
    batch: Sequence[list[Segment]],
    *,
    pad_id: int,
    shared_prefix_min: int = SHARED_PREFIX_MIN,
) -> torch.Tensor:
    """Mean cross-entropy over the trained tokens of `batch` (rows right-padded with `pad_id`);
    a shared prefix of at least `shared_prefix_min` tokens is run once (module doc)."""
    import torch

    width = max(sum(len(s) for s, _ in segments) for segments in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, segments in enumerate(batch):
        start = 0
        for seg, trained in segments:
            end = start + len(seg)
            ids[row, start:end] = torch.tensor(seg)
            if trained:
                labels[row, start:end] = torch.tensor(seg)
            start = end
        attention[row, :start] = 1
    shared = _shared_prefix(batch)
    if shared < shared_prefix_min:
        loss: torch.Tensor = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        return loss
    cache = model(input_ids=ids[:1, :shared], use_cache=True).cache
    cache.batch_repeat_interleave(len(batch))
    loss = model(
        input_ids=ids[:, shared:], attention_mask=attention, cache=cache, labels=labels[:, shared:]
    ).loss
    return loss


def _shared_prefix(batch: Sequence[list[Segment]]) -> int:
    """How many leading tokens every row of `batch` shares, short of the first trained token's
    predecessor (whose logits the rows' own forward must produce)."""
    rows = [[t for seg, _ in segments for t in seg] for segments in batch]
    limit = min(_first_trained(segments) for segments in batch) - 1
    n = 0
    while n < limit and all(row[n] == rows[0][n] for row in rows):
        n += 1
    return n


def _first_trained(segments: list[Segment]) -> int:
    start = 0
    for seg, trained in segments:
        if trained and seg:
            return start
        start += len(seg)
    return start


def _transcript(
    renderer: ChatRenderer,
    prompt: list[Message],
    toolbox: ToolBox,
    demonstration: Sequence[Message],
) -> list[Segment]:
    eos = str(renderer.tokenizer.eos_token)
    cut = renderer.turn_end.find(eos)
    # The part of the template's turn end the model samples (ChatML: `<|im_end|>`); the rest
    # (ChatML: the newline) is appended by the runner as context.
    sampled_end = renderer.turn_end[: cut + len(eos)] if cut >= 0 else ""
    opener: list[Message] = [{"role": "user", "content": "u"}]
    head = renderer.render(opener)
    segments: list[Segment] = [(renderer.prompt_ids(prompt, toolbox.schemas), False)]
    pending: list[Message] = []
    for i, message in enumerate(demonstration):
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            segments.append((renderer.new_message_ids(pending), False))
            pending = []
        elif i > 0:
            raise ValueError("two assistant turns in a row: the runner never produces that")
        full = renderer.render([*opener, message], add_generation_prompt=False)
        if not full.startswith(head):
            raise ValueError("the chat template renders an assistant turn differently in context")
        body, _ = renderer.split_turn_end(full[len(head) :])
        segments.append((renderer.encode(body + sampled_end), True))
        rest = renderer.turn_end[len(sampled_end) :]
        if rest and i + 1 < len(demonstration):
            segments.append((renderer.encode(rest), False))
    if pending or not demonstration:
        raise ValueError("a demonstration must end with an assistant turn")
    return segments


def warmup(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    tasks: Sequence[Task],
    env_factory: Callable[[], Env],
    settings: WarmupSettings,
    progress: Callable[[int, float], None] | None = None,
) -> Path:
    """Fine-tune `model_dir` on the tasks' references (module doc); save the result to
    `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples = [
        segments
        for segments in render_examples(
            tokenizer, env_factory, tasks, add_special_tokens=settings.add_special_tokens
        )
        if segments is not None and sum(len(ids) for ids, _ in segments) <= settings.max_len
    ]
    if not examples:
        raise ValueError(
            "warm-up found no task with a reference (a demonstration or an `answer`) that fits "
            "max_len"
        )
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
        loss = batch_loss(model, batch, pad_id=pad)
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
