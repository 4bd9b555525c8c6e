"""The environment API around the runner: loading envs from config strings, the prompt stream,
SingleTurnEnv, and scoring in a process pool."""

from __future__ import annotations

import operator
import time

import pytest

from dora.env import (
    Env,
    Episode,
    PromptStream,
    ScorerPool,
    SingleTurnEnv,
    Task,
    load_env,
    load_object,
)
from dora.episode import run_episode
from dora.errors import ConfigError
from dora.protocol import SamplingParams

pytestmark = pytest.mark.timeout(30)


class NeedsArgs(Env):
    def __init__(self, *, difficulty: int) -> None:
        self.difficulty = difficulty


def test_load_env_binds_kwargs_and_makes_fresh_objects() -> None:
    factory = load_env(f"{__name__}:NeedsArgs", difficulty=3)
    a, b = factory(), factory()
    assert isinstance(a, NeedsArgs) and a.difficulty == 3 and a is not b


class Shared:
    """A resource for every episode of a process (a pool, a database snapshot)."""

    made = 0

    def __init__(self, size: int) -> None:
        Shared.made += 1
        self.size = size


class SharingEnv(Env):
    def __init__(self, *, size: int = 1, shared: Shared | None = None) -> None:
        self.size = size
        self.shared = shared

    @classmethod
    def setup(cls, **kwargs: object) -> dict[str, object]:
        size = kwargs.get("size", 1)
        assert isinstance(size, int)
        return {"shared": Shared(size)}


class ClashingEnv(SharingEnv):
    @classmethod
    def setup(cls, **kwargs: object) -> dict[str, object]:
        return {"size": 2}


def test_setup_makes_shared_resources_once_for_every_episode_of_the_factory() -> None:
    before = Shared.made
    factory = load_env(f"{__name__}:SharingEnv", size=3)
    a, b = factory(), factory()
    assert isinstance(a, SharingEnv) and isinstance(b, SharingEnv) and a is not b
    assert a.shared is b.shared and a.shared is not None and a.shared.size == 3
    assert Shared.made == before + 1  # once per load_env, not once per episode
    with pytest.raises(ConfigError, match=r"setup\(\) returned \['size'\]"):
        load_env(f"{__name__}:ClashingEnv", size=1)
    assert Env.setup() == {}  # the default shares nothing


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("no_colon", {}, "is not of the form 'package.module:Name'"),
        ("no_such_module_xyz:Env", {}, "cannot import module 'no_such_module_xyz'"),
        ("dora.env:Nope", {}, "has no attribute 'Nope'; it has: "),
        ("dora.env:load_env", {}, "not a subclass of dora.Env"),
        (f"{__name__}:NeedsArgs", {"difficulty": 1, "colour": "red"}, "cannot build"),
        (f"{__name__}:NeedsArgs", {}, "difficulty"),
    ],
)
def test_load_env_errors_say_what_and_how(spec: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_env(spec, **kwargs)


def test_load_object_follows_dotted_attributes() -> None:
    assert load_object("dora.env:PromptStream.next") is PromptStream.next


def tasks(n: int) -> list[Task]:
    return [Task(f"p{i}", {"i": i}) for i in range(n)]


def test_prompt_stream_cycles_reshuffles_and_resumes() -> None:
    stream = PromptStream(tasks(5), seed=1)
    drawn = [stream.next().prompt_id for _ in range(15)]
    epochs = [drawn[0:5], drawn[5:10], drawn[10:15]]
    assert all(sorted(e) == [f"p{i}" for i in range(5)] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1, "each epoch is reshuffled"
    assert stream.position == 15 and stream.epoch == 3

    again = [t.prompt_id for t, _ in zip(PromptStream(tasks(5), seed=1), range(15), strict=False)]
    assert again == drawn, "same seed, same stream"
    resumed = PromptStream(tasks(5), seed=1, position=7)
    assert [resumed.next().prompt_id for _ in range(8)] == drawn[7:]
    other = PromptStream(tasks(5), seed=2)
    assert [other.next().prompt_id for _ in range(15)] != drawn

    plain = PromptStream(tasks(3), shuffle=False)
    assert [plain.next().prompt_id for _ in range(4)] == ["p0", "p1", "p2", "p0"]


def test_prompt_stream_refuses_empty_or_duplicate_ids() -> None:
    with pytest.raises(ConfigError, match="empty"):
        PromptStream([])
    with pytest.raises(ConfigError, match="'p1' appears more than once"):
        PromptStream([*tasks(2), Task("p1")])


class Echo(SingleTurnEnv):
    system_prompt = "Answer with a number."

    def score(self, answer: str, task: Task) -> float:
        return float(answer.strip() == str(task["answer"]))


async def test_single_turn_env(tokenizer, scripted) -> None:
    task = Task("q", {"question": "1+1?", "answer": 2})
    assert Echo().reset(task) == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "1+1?"},
    ]
    sample = await run_episode(
        sampler=scripted(["2<|im_end|>"]),
        tokenizer=tokenizer,
        env=Echo(),
        task=task,
        params=SamplingParams(max_tokens=20),
    )
    assert sample.reward == 1.0 and sample.num_turns == 1 and sample.finish_reason == "stop"

    # Without tools, a tool call is just text: the episode stays single-turn.
    sample = await run_episode(
        sampler=scripted(['<tool_call>{"name": "x", "arguments": {}}</tool_call><|im_end|>']),
        tokenizer=tokenizer,
        env=Echo(),
        task=task,
        params=SamplingParams(max_tokens=60),
    )
    assert (sample.num_turns, sample.num_tool_calls, sample.reward) == (1, 0, 0.0)

    class Raw(Echo):
        chat = False

    assert Raw().reset(task) == "1+1?"
    with pytest.raises(KeyError, match="override prompt"):
        Echo().prompt(Task("x", {"text": "?"}))


def test_env_base_class_explains_what_is_missing() -> None:
    with pytest.raises(NotImplementedError, match="reset"):
        Env().reset(Task("x"))
    episode = Episode(Task("x"), [], "", "stop", 1, 0, 0)
    with pytest.raises(NotImplementedError, match="reward"):
        Env().reward(episode)
    assert Env().step([]) == ([], True) and Env().tools() == []


async def test_scorer_pool_runs_in_a_process_and_times_out() -> None:
    async with ScorerPool(timeout_s=20) as pool:
        assert await pool.run(operator.mul, 6, 7) == 42
        with pytest.raises(ZeroDivisionError):
            await pool.run(operator.truediv, 1, 0)
        pool.timeout_s = 0.5
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await pool.run(time.sleep, 30)
        assert time.monotonic() - started < 10
        pool.timeout_s = 20
        assert await pool.run(operator.add, 1, 2) == 3, "a fresh pool replaces the poisoned one"
