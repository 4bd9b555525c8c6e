"""A test-local stand-in for `dora serve`: a real ServeLink, groups sampled from a tiny model.

It plays the protocol the trainer relies on: wait for `Hello`, then per step send `Assigned`
groups and `StepClosed`, then collect `WeightChunk`s / `WeightsReady` / `StepDone` / `Durable`, and
load each published version into its own copy of the model, so the next groups are on-policy.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dora.learn.publish import state_dict_from_chunks
from dora.link import ServeLink
from dora.protocol import (
    Assigned,
    Group,
    Hello,
    LearnMessage,
    Sample,
    Shutdown,
    StepClosed,
    StepDone,
    WeightChunk,
    WeightsReady,
)

PROMPT = "Say digits:"
DIGITS = set("0123456789")


def digit_reward(text: str) -> float:
    return sum(ch in DIGITS for ch in text) / max(len(text), 1)


@torch.no_grad()
def sample_group(
    model: torch.nn.Module,
    tokenizer: object,
    *,
    gid: str,
    version: int,
    group_size: int,
    new_tokens: int,
    generator: torch.Generator,
) -> Group:
    """G completions of PROMPT at temperature 1 with their behaviour logprobs (no KV cache)."""
    prompt = tokenizer(PROMPT)["input_ids"]  # type: ignore[operator]
    ids = torch.tensor([prompt] * group_size)
    logps: list[torch.Tensor] = []
    for _ in range(new_tokens):
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, -1].float(), -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator)
        logps.append(logp.gather(-1, nxt).squeeze(-1))
        ids = torch.cat([ids, nxt], dim=1)
    lp = torch.stack(logps, dim=1)
    n = len(prompt)
    samples = []
    for i in range(group_size):
        text = tokenizer.decode(ids[i, n:])  # type: ignore[attr-defined]
        samples.append(
            Sample.build(
                token_ids=ids[i].numpy(),
                loss_mask=[0] * n + [1] * new_tokens,
                logprobs=[0.0] * n + lp[i].tolist(),
                versions=[-1] * n + [version] * new_tokens,
                prompt_len=n,
                reward=digit_reward(text),
            )
        )
    return Group(id=gid, prompt_id="p0", version=version, samples=samples)


@torch.no_grad()
def completion_logprob(model: torch.nn.Module, tokenizer: object, completion: str) -> float:
    """log p(completion | PROMPT): how much the policy likes a rewarded answer."""
    prompt = tokenizer(PROMPT)["input_ids"]  # type: ignore[operator]
    full = tokenizer(PROMPT + completion)["input_ids"]  # type: ignore[operator]
    ids = torch.tensor([full])
    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    per_token = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return float(per_token[len(prompt) - 1 :].sum())


@dataclass
class Record:
    """Everything the trainer sent, in order."""

    messages: list[LearnMessage] = field(default_factory=list)
    hello: Hello | None = None

    def of(self, kind: type) -> list:  # type: ignore[type-arg]
        return [m for m in self.messages if isinstance(m, kind)]


GroupMaker = Callable[[int, int], list[Group]]  # (step, version) -> the groups of that step


class StandIn:
    def __init__(self, model_dir: Path, *, on_policy: bool = True) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.link = ServeLink()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.version = 0
        self.base = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.published: dict[int, dict[str, torch.Tensor]] = {}
        self.on_policy = on_policy
        self.record = Record()

    async def recv(self, timeout_s: float = 120) -> LearnMessage:
        message = await asyncio.wait_for(self.link.recv(), timeout_s)
        self.record.messages.append(message)
        return message

    async def serve(
        self, steps: range, make_groups: GroupMaker, *, shutdown_after: int | None = None
    ) -> Record:
        hello = await self.recv()
        assert isinstance(hello, Hello) and hello.role == "learn"
        self.record.hello = hello
        assert hello.step == steps.start, (hello, steps)
        for step in steps:
            groups = make_groups(step, self.version)
            for group in groups:
                await self.link.send(Assigned(step=step, group=group))
            await self.link.send(StepClosed(step=step, num_groups=len(groups)))
            await self._until_step_done(step)
            if shutdown_after == step:
                await self.link.send(Shutdown(reason="test stops serve"))
                break
        return self.record

    async def _until_step_done(self, step: int) -> None:
        chunks: list[WeightChunk] = []
        while True:
            message = await self.recv()
            if isinstance(message, WeightChunk):
                chunks.append(message)
            elif isinstance(message, WeightsReady):
                # step + 1 is the step's publication; step itself is a resumed trainer's start
                assert message.version in (step, step + 1)
                if message.path:
                    from dora.engine.worker import read_safetensors

                    state = read_safetensors(message.path)
                    if "model.embed_tokens.weight" in state:
                        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
                else:
                    assert len(chunks) == message.num_chunks
                    state = state_dict_from_chunks(chunks)
                self.published[message.version] = state
                if self.on_policy:
                    self.model.load_state_dict(self._full(state))
                self.version = message.version
            elif isinstance(message, StepDone):
                assert message.step == step
                return

    def _full(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's weights for a published version: as they are, or, for a LoRA adapter
        (B already scaled), the base plus `B @ A` merged into each targeted weight."""
        if not all(".lora_" in name for name in state):
            return state
        full = {k: v.clone() for k, v in self.base.items()}
        for name, a in state.items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = state[name.replace(".lora_A.", ".lora_B.")]
                full[f"{module}.weight"] += b @ a
        return full

    async def drain(self) -> None:
        """After the trainer exited: collect what it sent last (Durable, Shutdown)."""
        while True:
            try:
                await self.recv(timeout_s=0.5)
            except TimeoutError:
                return

    def close(self) -> None:
        self.link.close()


def learn_args(config: Path, *overrides: str, resume: bool = False) -> argparse.Namespace:
    return argparse.Namespace(config=str(config), overrides=list(overrides), resume=resume)


async def run_learn_in_thread(args: argparse.Namespace) -> asyncio.Future[int]:
    """Start `dora learn` (one process) in a thread; the future resolves to its exit status."""
    from dora.learn.main import main

    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    def target() -> None:
        try:
            rc = main(args)
        except BaseException as exc:  # handed to the test, which re-raises it
            loop.call_soon_threadsafe(future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(future.set_result, rc)

    threading.Thread(target=target, daemon=True).start()
    return future
