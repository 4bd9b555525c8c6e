"""The episode runner, token for token, against a scripted sampler and the tiny model's chat
template."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from dora.env import Env, Episode, Message, Task
from dora.episode import (
    ChatRenderer,
    EpisodeLimits,
    GroupFailed,
    run_episode,
    run_group,
)
from dora.errors import ServerUnavailable
from dora.protocol import Completion, Sample, SamplingParams
from dora.serve.history import masked_reason
from dora.tools import tool_schema

pytestmark = pytest.mark.timeout(30)

END = "<|im_end|>"
PARAMS = SamplingParams(max_tokens=200)
TASK = Task("t0", {"question": "What is (2 + 3) * 4?", "answer": "20"})


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term.
        b: the second term.
    """
    return a + b


async def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


class CalcEnv(Env):
    """A tool-using env that remembers the episode it was scored on."""

    def __init__(self) -> None:
        self.episode: Episode | None = None

    def reset(self, task: Task) -> list[Message]:
        return [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": str(task["question"])},
        ]

    def tools(self) -> list[object]:
        return [add, mul]

    async def reward(self, episode: Episode) -> dict[str, float]:
        self.episode = episode
        correct = float(str(episode.task["answer"]) in episode.completion)
        return {"correct": correct, "tool_use": 0.25 * episode.num_tool_calls}


def call(name: str, **args: int) -> str:
    """A tool call in the template's own format (so re-rendering reproduces it)."""
    inner = ", ".join(f'"{k}": {v}' for k, v in args.items())
    return f'<tool_call>{{"name": "{name}", "arguments": {{{inner}}}}}</tool_call>'


THREE_TURNS = [
    "Let me add." + call("add", a=2, b=3) + END,
    call("mul", a=5, b=4) + END,
    "The answer is 20." + END,
]


async def test_three_turn_tool_episode_equals_template_rendering(tokenizer, scripted) -> None:
    sampler = scripted(THREE_TURNS)
    env = CalcEnv()
    sample = await run_episode(
        sampler=sampler, tokenizer=tokenizer, env=env, task=TASK, params=PARAMS
    )
    assert not sample.masked
    assert sample.finish_reason == "stop"
    assert (sample.num_turns, sample.num_tool_calls) == (3, 2)
    assert env.episode is not None
    messages = env.episode.messages
    assert isinstance(messages, list)
    assert [m["role"] for m in messages] == [
        "system", "user", "assistant", "tool", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["5", "20"]

    # The whole conversation rendered by the chat template, tokenized once. The only difference: the
    # template closes the last assistant turn with "<|im_end|>\n"; the model stopped at "<|im_end|>"
    # and nothing follows, so the trajectory ends there.
    renderer = ChatRenderer(tokenizer)
    rendered = renderer.render(
        messages, tools=[tool_schema(add), tool_schema(mul)], add_generation_prompt=False
    )
    assert rendered.endswith(END + "\n")
    expected = tokenizer.encode(rendered[:-1], add_special_tokens=False)
    tokens = sample.tokens().tolist()
    assert tokens == expected

    # The loss mask is 1 exactly on the sampled tokens, in three runs, each right after the
    # "<|im_start|>assistant\n" generation prompt; log-probs and versions ride on those tokens only.
    mask = sample.mask()
    sampled = [t for turn in sampler.sampled for t in turn]
    assert mask.sum() == len(sampled)
    assert np.asarray(tokens)[mask == 1].tolist() == sampled
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    starts, ends = runs[0::2], runs[1::2]
    assert [e - s for s, e in zip(starts, ends, strict=True)] == [len(t) for t in sampler.sampled]
    gen_prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for s in starts:
        assert tokens[s - len(gen_prompt) : s] == gen_prompt
    logprobs = sample.behaviour_logprobs()
    np.testing.assert_allclose(
        logprobs[mask == 1], [sampler.logprob(i) for i in range(len(sampled))], rtol=1e-6
    )
    assert (logprobs[mask == 0] == 0).all()
    versions = sample.token_versions()
    assert (versions[mask == 1] == 7).all() and (versions[mask == 0] == -1).all()
    assert sample.prompt_len == len(sampler.prompts[0])

    # Every request continued the exact tokens so far: nothing was re-tokenized between turns.
    for prompt in sampler.prompts:
        assert tokens[: len(prompt)] == prompt

    # Reward components reach the Sample; the reward is their sum.
    assert sample.reward_components == {"correct": 1.0, "tool_use": 0.5}
    assert sample.reward == pytest.approx(1.5)


async def test_sampled_tokens_are_kept_verbatim_when_rerendering_would_differ(
    tokenizer, scripted
) -> None:
    # Compact JSON: the template would re-render this call with spaces. The trajectory keeps what
    # the model sampled, so it differs from a re-rendering exactly there (hence: never re-render).
    compact = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>' + END
    sampler = scripted([compact, "5" + END])
    env = CalcEnv()
    sample = await run_episode(
        sampler=sampler, tokenizer=tokenizer, env=env, task=TASK, params=PARAMS
    )
    text = tokenizer.decode(sample.tokens().tolist())
    assert compact in text
    assert env.episode is not None and env.episode.num_tool_errors == 0

    rerendered = ChatRenderer(tokenizer).render(
        env.episode.messages,  # type: ignore[arg-type]
        tools=[tool_schema(add), tool_schema(mul)],
        add_generation_prompt=False,
    )
    assert compact not in rerendered


async def test_malformed_and_unknown_tool_calls_become_tool_errors(tokenizer, scripted) -> None:
    turns = [
        "<tool_call>{not json}</tool_call>" + END,
        call("divide", a=1, b=2) + END,
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>' + END,
        '<tool_call>{"arguments": {}}</tool_call>' + END,
        "done" + END,
    ]
    env = CalcEnv()
    sample = await run_episode(
        sampler=scripted(turns), tokenizer=tokenizer, env=env, task=TASK, params=PARAMS
    )
    assert not sample.masked and sample.num_turns == 5
    assert env.episode is not None
    tool_msgs = [m["content"] for m in env.episode.messages if m["role"] == "tool"]  # type: ignore[index]
    assert len(tool_msgs) == 4
    assert tool_msgs[0].startswith("Error: malformed tool call: tool call is not valid JSON")
    assert "unknown tool 'divide'" in tool_msgs[1] and "add, mul" in tool_msgs[1]
    assert "bad arguments for 'add'" in tool_msgs[2] and "b" in tool_msgs[2]
    assert 'missing "name"' in tool_msgs[3]
    assert env.episode.num_tool_errors == 4
    assert "Error: malformed tool call" in tokenizer.decode(sample.tokens().tolist())


def boom(x: int) -> int:
    """Always fails."""
    raise RuntimeError(f"kaboom {x}")


async def hang(x: int) -> int:
    """Never returns in time."""
    await asyncio.sleep(60)
    return x


SLOW_THREADS: list[str] = []


def slow(x: int) -> int:
    """A sync tool that blocks longer than the timeout (it runs in a thread)."""
    SLOW_THREADS.append(threading.current_thread().name)
    time.sleep(0.3)
    return x


class FlakyToolsEnv(CalcEnv):
    def tools(self) -> list[object]:
        return [boom, hang, slow]


async def test_tool_that_raises_or_hangs_becomes_an_error_message(tokenizer, scripted) -> None:
    turns = [call("boom", x=1) + call("hang", x=2) + call("slow", x=3) + END, "ok" + END]
    env = FlakyToolsEnv()
    started = time.monotonic()
    sample = await run_episode(
        sampler=scripted(turns),
        tokenizer=tokenizer,
        env=env,
        task=TASK,
        params=PARAMS,
        limits=EpisodeLimits(tool_timeout_s=0.1),
    )
    assert time.monotonic() - started < 5
    assert not sample.masked
    assert env.episode is not None
    tool_msgs = [m["content"] for m in env.episode.messages if m["role"] == "tool"]  # type: ignore[index]
    assert tool_msgs[0] == "Error: tool 'boom' raised RuntimeError: kaboom 1"
    assert tool_msgs[1] == "Error: tool 'hang' timed out after 0.1 s"
    assert tool_msgs[2] == "Error: tool 'slow' timed out after 0.1 s"
    assert SLOW_THREADS[-1].startswith("dora-tool"), "not the loop's default executor"
    assert sample.metadata["tool_errors"] == "3"


class FailingEnv(CalcEnv):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def reset(self, task: Task) -> list[Message]:
        if self.where == "reset":
            raise KeyError("no such task")
        return super().reset(task)

    def step(self, messages: list[Message] | str) -> tuple[list[Message], bool]:
        if self.where == "step":
            raise ValueError("the simulated user crashed")
        if self.where == "bad-step":
            return None  # type: ignore[return-value]
        if self.where == "bad-reply":
            return ["not a message"], False  # type: ignore[list-item]
        return [], True

    async def reward(self, episode: Episode) -> dict[str, float]:
        if self.where == "reward":
            raise ZeroDivisionError("scorer bug")
        if self.where == "bad-reward":
            return "high"  # type: ignore[return-value]
        if self.where == "nan-reward":
            return float("nan")  # type: ignore[return-value]
        if self.where == "inf-component":
            return {"correct": 1.0, "style": float("-inf")}
        return await super().reward(episode)


@pytest.mark.parametrize(
    "where",
    [
        *("reset", "step", "bad-step", "bad-reply", "reward", "bad-reward"),
        *("nan-reward", "inf-component"),
    ],
)
async def test_env_that_raises_gives_a_masked_sample(tokenizer, scripted, where, caplog) -> None:
    sample = await run_episode(
        sampler=scripted(["20" + END]),
        tokenizer=tokenizer,
        env=FailingEnv(where),
        task=TASK,
        params=PARAMS,
    )
    assert sample.masked
    assert sample.finish_reason == "error"
    assert sample.reward == 0.0
    assert sample.metadata["prompt_id"] == "t0"
    assert sample.metadata["error"]
    if where in ("nan-reward", "inf-component"):
        assert sample.metadata["error"].startswith("reward returned ")
        assert "not finite" in sample.metadata["error"]
    assert len(sample.mask()) == len(sample.tokens()) == len(sample.behaviour_logprobs())
    if where == "reset":
        assert len(sample) == 0
    else:
        assert sample.mask().sum() == 3  # the sampled turn is kept, for inspection


async def test_group_policy_mask_and_retry(tokenizer, scripted) -> None:
    made = []

    def factory() -> Env:
        made.append(1)
        return FailingEnv("reward" if len(made) == 2 else "none")

    sampler = scripted(["The answer is 20." + END])
    kwargs = dict(sampler=sampler, tokenizer=tokenizer, task=TASK, group_size=4, params=PARAMS)
    samples = await run_group(env_factory=factory, **kwargs)  # type: ignore[arg-type]
    assert len(samples) == 4 and len(made) == 4
    assert [s.masked for s in samples].count(True) == 1
    assert all(s.reward == 1.0 for s in samples if not s.masked)

    made.clear()
    with pytest.raises(GroupFailed) as info:
        await run_group(env_factory=factory, on_error="retry", **kwargs)  # type: ignore[arg-type]
    assert info.value.prompt_id == "t0"
    assert len(info.value.samples) == 4 and len(info.value.errors) == 1
    assert "scorer bug" in info.value.errors[0]

    def broken_factory() -> Env:
        raise TypeError("missing argument")

    samples = await run_group(env_factory=broken_factory, **kwargs)  # type: ignore[arg-type]
    assert all(s.masked for s in samples)
    # counted under one reason, whether serve's dispatcher or run_group started the episode
    reasons = {masked_reason(s.metadata, s.finish_reason) for s in samples}
    assert reasons == {"env factory raised TypeError"}


async def test_limits_end_the_episode(tokenizer, scripted) -> None:
    looping = [call("add", a=1, b=1) + END]

    async def run(sampler: object, **limits: int) -> Sample:
        return await run_episode(
            sampler=sampler,  # type: ignore[arg-type]
            tokenizer=tokenizer,
            env=CalcEnv(),
            task=TASK,
            params=PARAMS,
            limits=EpisodeLimits(**limits),
        )

    sample = await run(scripted(looping), max_turns=3)
    assert (sample.finish_reason, sample.num_turns, sample.num_tool_calls) == ("max_turns", 3, 3)
    assert sample.tokens()[-1] == tokenizer.convert_tokens_to_ids(END)

    turn = len(tokenizer.encode(looping[0], add_special_tokens=False))
    sampler = scripted(looping)
    sample = await run(sampler, max_total_tokens=2 * turn + 10)
    assert sample.finish_reason == "length"
    assert sample.mask().sum() == 2 * turn + 10
    assert sampler.params[-1].max_tokens == 10

    # The tool result after the first turn would cross the context limit: it is not appended.
    limit = len(sampler.prompts[0]) + turn + 20
    sample = await run(scripted(looping), context_limit=limit)
    assert sample.finish_reason == "context" and sample.num_turns == 1
    assert len(sample) <= limit

    sample = await run(scripted(looping), context_limit=10)
    assert sample.masked and sample.finish_reason == "context"


async def test_serve_caps_each_turn_with_rollout_max_tokens_per_turn(tokenizer, scripted) -> None:
    # the sampling parameters and limits `dora serve` builds from its config
    from dora.config import load_config
    from dora.serve.dispatcher import episode_limits, turn_max_tokens

    looping = [call("add", a=1, b=1) + END]
    turn = len(tokenizer.encode(looping[0], add_special_tokens=False))

    async def run(*overrides: str) -> tuple[Sample, object]:
        cfg = load_config(None, ["rollout.max_turns=3", *overrides])
        sampler = scripted(looping)
        sample = await run_episode(
            sampler=sampler,
            tokenizer=tokenizer,
            env=CalcEnv(),
            task=TASK,
            params=SamplingParams(max_tokens=turn_max_tokens(cfg.rollout)),
            limits=episode_limits(cfg),
        )
        return sample, sampler

    # without a per-turn cap, a turn may take what the episode has left
    sample, sampler = await run("rollout.max_tokens=256")
    assert [p.max_tokens for p in sampler.params] == [256, 256 - turn, 256 - 2 * turn]
    assert sample.finish_reason == "max_turns"
    # a cap above a turn's length bounds every call and changes nothing else
    sample, sampler = await run("rollout.max_tokens=256", f"rollout.max_tokens_per_turn={turn + 1}")
    assert [p.max_tokens for p in sampler.params] == [turn + 1] * 3
    assert sample.finish_reason == "max_turns"
    # a turn that runs into the cap is cut there, and the episode ends as too long
    sample, sampler = await run("rollout.max_tokens=256", f"rollout.max_tokens_per_turn={turn - 4}")
    assert [p.max_tokens for p in sampler.params] == [turn - 4]
    assert (sample.finish_reason, sample.num_turns) == ("length", 1)
    assert sample.mask().sum() == turn - 4


class TextEnv(Env):
    """Completion-style: a plain-text prompt, and a reply appended as raw text."""

    def __init__(self) -> None:
        self.received: list[str] = []

    def reset(self, task: Task) -> str:
        return "Q: 2+2=?\nA:"

    def step(self, messages: list[Message] | str) -> tuple[str, bool]:
        assert isinstance(messages, str)
        self.received.append(messages)
        if len(self.received) >= 2:
            return "", True
        return "\nQ: and 3+3?\nA:", False

    def reward(self, episode: Episode) -> float:
        return 1.0 if episode.completion.strip() == "6" else 0.0


async def test_plain_text_prompt_has_no_chat_template(tokenizer, scripted) -> None:
    sampler = scripted([" 4", " 6"])
    env = TextEnv()
    sample = await run_episode(
        sampler=sampler, tokenizer=tokenizer, env=env, task=TASK, params=PARAMS
    )
    assert tokenizer.decode(sample.tokens().tolist()) == "Q: 2+2=?\nA: 4\nQ: and 3+3?\nA: 6"
    assert env.received == [" 4", " 6"]  # step gets the model's turn, not the whole text
    assert sample.prompt_len == len("Q: 2+2=?\nA:")
    assert sample.mask().sum() == 4 and sample.reward == 1.0


class UserSimEnv(Env):
    """A simulated user that asks one follow-up question."""

    def reset(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": "Hi"}]

    def __init__(self) -> None:
        self.turns = 0

    async def step(self, messages: list[Message] | str) -> tuple[list[Message], bool]:
        self.turns += 1
        if self.turns == 1:
            return [{"role": "user", "content": "And then?"}], False
        return [], True

    def reward(self, episode: Episode) -> float:
        return float(episode.num_turns)


async def test_step_reply_is_rendered_like_the_template(tokenizer, scripted) -> None:
    sample = await run_episode(
        sampler=scripted(["Hello" + END, "Bye" + END]),
        tokenizer=tokenizer,
        env=UserSimEnv(),
        task=TASK,
        params=PARAMS,
    )
    conversation: list[Message] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "Bye"},
    ]
    rendered = ChatRenderer(tokenizer).render(conversation, add_generation_prompt=False)
    assert tokenizer.decode(sample.tokens().tolist()) == rendered[:-1]
    assert sample.reward == 2.0


class ReceivingEnv(CalcEnv):
    """A calculator with a user who asks twice; keeps what each `step` received."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[list[Message]] = []

    def step(self, messages: list[Message] | str) -> tuple[list[Message], bool]:
        assert isinstance(messages, list)
        self.received.append(messages)
        if len(self.received) == 1:
            return [{"role": "user", "content": "And 4 * 5?"}], False
        return [], True


async def test_step_receives_the_messages_new_since_the_env_last_spoke(tokenizer, scripted) -> None:
    """The model's turns since the prompt or the env's last reply, with their tool calls and
    results, ending with the turn that called no tool; never the prompt or earlier replies."""
    env = ReceivingEnv()
    turns = [
        call("add", a=2, b=3) + END,
        "5" + END,
        call("mul", a=4, b=5) + END,
        call("add", a=20, b=0) + END,
        "20" + END,
    ]
    sample = await run_episode(
        sampler=scripted(turns), tokenizer=tokenizer, env=env, task=TASK, params=PARAMS
    )
    assert sample.finish_reason == "stop" and sample.num_turns == 5
    roles = [[m["role"] for m in received] for received in env.received]
    assert roles == [
        ["assistant", "tool", "assistant"],
        ["assistant", "tool", "assistant", "tool", "assistant"],
    ]
    first, second = env.received
    assert [m["content"] for m in first] == ["", "5", "5"]
    assert [m["content"] for m in second] == ["", "20", "", "20", "20"]
    assert [c["function"]["name"] for c in second[0]["tool_calls"]] == ["mul"]
    # the reward still sees the whole conversation
    assert env.episode is not None and isinstance(env.episode.messages, list)
    assert len(env.episode.messages) == 2 + len(first) + 1 + len(second)


async def test_end_of_turn_the_model_did_not_sample_is_appended_unmasked(
    tokenizer, scripted
) -> None:
    # Sampling stopped on a stop string, without <|im_end|>: the runner closes the turn itself, and
    # those closing tokens are not trained on.
    sampler = scripted([call("add", a=1, b=2), "3" + END])
    sample = await run_episode(
        sampler=sampler, tokenizer=tokenizer, env=CalcEnv(), task=TASK, params=PARAMS
    )
    tokens, mask = sample.tokens().tolist(), sample.mask()
    first_end = len(sampler.prompts[0]) + len(sampler.sampled[0])
    assert tokenizer.decode(tokens[first_end : first_end + 2]) == END + "\n"
    assert mask[first_end : first_end + 2].tolist() == [0, 0]


class DeadSampler:
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        raise ServerUnavailable("instance 3 is gone")


class AbortingSampler:
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        return Completion(
            request_id="x", token_ids=[], logprobs=[], versions=[], finish_reason="abort"
        )


async def test_sampler_errors_propagate_and_aborts_mask(tokenizer) -> None:
    with pytest.raises(ServerUnavailable):
        await run_episode(
            sampler=DeadSampler(), tokenizer=tokenizer, env=CalcEnv(), task=TASK, params=PARAMS
        )
    sample = await run_episode(
        sampler=AbortingSampler(), tokenizer=tokenizer, env=CalcEnv(), task=TASK, params=PARAMS
    )
    assert sample.masked and sample.finish_reason == "abort"


class BlockingSampler:
    """Every call blocks; `started` is set once `expected` calls are waiting (the episodes reach
    the sampler at their own pace: their environment hooks run in threads first)."""

    def __init__(self, expected: int = 1) -> None:
        self.started = asyncio.Event()
        self.expected = expected
        self.calls = 0
        self.cancelled = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        self.calls += 1
        if self.calls >= self.expected:
            self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")


async def test_cancelling_a_group_cancels_every_episode(tokenizer) -> None:
    sampler = BlockingSampler(expected=3)
    group = asyncio.ensure_future(
        run_group(
            sampler=sampler,
            tokenizer=tokenizer,
            env_factory=CalcEnv,
            task=TASK,
            group_size=3,
            params=PARAMS,
        )
    )
    await sampler.started.wait()
    await asyncio.sleep(0)
    group.cancel()
    with pytest.raises(asyncio.CancelledError):
        await group
    assert sampler.cancelled == 3


async def test_sampler_gets_its_own_copy_of_the_context_as_an_int32_array(tokenizer) -> None:
    """No list conversion each turn: the sampler gets a typed array, a copy it may keep."""
    from array import array

    got: list[tuple[object, int]] = []

    class Keeping:
        async def generate(self, prompt_ids: object, params: SamplingParams) -> Completion:
            got.append((prompt_ids, len(prompt_ids)))  # type: ignore[arg-type]
            return Completion(
                request_id="r", token_ids=[5], logprobs=[-0.1], versions=[0], finish_reason="stop"
            )

    sample = await run_episode(
        sampler=Keeping(), tokenizer=tokenizer, env=CalcEnv(), task=TASK, params=PARAMS
    )
    assert got and all(isinstance(p, array) and p.typecode == "i" for p, _ in got)
    assert all(len(p) == n for p, n in got)  # the episode went on without changing them
    assert len(sample.token_ids) > got[-1][1]
