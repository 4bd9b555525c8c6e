"""The warm-up's references: a multi-turn demonstration becomes exactly the token sequence the
episode runner builds (loss on the assistant turns only), a task's answer stays the reply to the
prompt, and a long shared prefix is computed once without changing the loss."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from dora.data import load_tasks
from dora.env import Env, Episode, Message, Task, load_env
from dora.episode import run_episode
from dora.errors import EnvError
from dora.models import TinyModelSpec, build_tiny_model
from dora.models.warmup import _shared_prefix, batch_loss, render_examples
from dora.protocol import SamplingParams
from dora.tools import ToolCall

pytestmark = pytest.mark.timeout(60)


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up.
    """
    return {"color": "blue"}.get(key, "unknown")


class DemoEnv(Env):
    """A tool and a scripted user, with a demonstration of the episode it wants."""

    closed = 0

    def reset(self, task: Task) -> list[Message]:
        self.replies = ["Thanks, bye."]
        return [
            {"role": "system", "content": "You look things up. " * 40},
            {"role": "user", "content": f"What is the {task['key']}?"},
        ]

    def tools(self) -> list[object]:
        return [lookup]

    def step(self, messages: list[Message] | str) -> tuple[list[Message], bool]:
        if not self.replies:
            return [], True
        return [{"role": "user", "content": self.replies.pop(0)}], False

    def reward(self, episode: Episode) -> float:
        return 1.0

    def demonstration(self, task: Task) -> list[Message]:
        key = str(task["key"])
        call: ToolCall = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps({"key": key})},
        }
        return [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": lookup(key), "tool_call_id": "call_0", "name": "lookup"},
            {"role": "assistant", "content": f"It is {lookup(key)}."},
            {"role": "user", "content": "Thanks, bye."},
            {"role": "assistant", "content": "Goodbye!"},
        ]

    async def close(self) -> None:
        DemoEnv.closed += 1


async def test_a_demonstration_is_the_token_sequence_of_the_runner(tokenizer, scripted) -> None:
    task = Task("k", {"key": "color"})
    DemoEnv.closed = 0
    [segments] = await asyncio.to_thread(render_examples, tokenizer, DemoEnv, [task])
    assert segments is not None and DemoEnv.closed == 1
    turns = [tokenizer.decode(ids) for ids, trained in segments if trained]  # type: ignore[attr-defined]
    assert turns == [
        '<tool_call>{"name": "lookup", "arguments": {"key": "color"}}</tool_call><|im_end|>',
        "It is blue.<|im_end|>",
        "Goodbye!<|im_end|>",
    ]
    # Sampling exactly the demonstrated turns through the real runner gives the same tokens, and
    # its loss mask covers exactly the demonstrated turns.
    sample = await run_episode(
        sampler=scripted(turns),
        tokenizer=tokenizer,  # type: ignore[arg-type]
        env=DemoEnv(),
        task=task,
        params=SamplingParams(max_tokens=200),
    )
    assert (sample.num_turns, sample.num_tool_calls, sample.finish_reason) == (3, 1, "stop")
    assert sample.tokens().tolist() == [t for ids, _ in segments for t in ids]
    assert sample.mask().tolist() == [int(trained) for ids, trained in segments for _ in ids]


def test_an_answer_is_the_reply_to_the_prompt(tokenizer) -> None:
    [task] = load_tasks("envs.math:chain_arithmetic_tasks", kwargs={"n": 1, "max_terms": 3})
    [segments] = render_examples(tokenizer, load_env("envs.math:ChainArithmeticEnv"), [task])
    assert segments is not None
    prompt = load_env("envs.math:ChainArithmeticEnv")().reset(task)
    expected_prompt = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    answer = tokenizer.encode(str(task["answer"]), add_special_tokens=False)  # type: ignore[attr-defined]
    assert segments == [(expected_prompt, False), ([*answer, tokenizer.eos_token_id], True)]  # type: ignore[attr-defined]


class BrokenEnv(DemoEnv):
    def reset(self, task: Task) -> list[Message]:
        raise KeyError("question")


def test_an_environment_failing_in_the_warm_up_is_named_with_its_task(tokenizer) -> None:
    task = Task("p7", {"question": "q", "answer": "a"})
    with pytest.raises(EnvError) as info:
        render_examples(tokenizer, BrokenEnv, [task])
    message = str(info.value)
    assert f"{__name__}.BrokenEnv" in message and "task 'p7'" in message, message
    assert "KeyError: 'question'" in message, message


def test_a_shared_prefix_runs_once_with_the_same_loss_and_gradients(
    tokenizer, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tasks = [Task("a", {"key": "color"}), Task("b", {"key": "size"})]
    batch = [s for s in render_examples(tokenizer, DemoEnv, tasks) if s is not None]
    assert _shared_prefix(batch) > 800  # the system prompt and the tool schema
    base = build_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=32, num_layers=1))
    model = AutoModelForCausalLM.from_pretrained(base)
    grads = []
    losses = []
    for shared_min in (1, 10**9):  # the prefix run once, then every row in full
        model.zero_grad()
        loss = batch_loss(model, batch, pad_id=0, shared_prefix_min=shared_min)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-5)
