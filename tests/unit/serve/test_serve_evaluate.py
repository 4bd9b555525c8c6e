"""The evaluator against the real orchestrator, with fakes around it (a scripted sampler instead
of instances): a due evaluation whose version is superseded before it finds room
evaluates the version that takes requests, instead of waiting for room that never comes; the end
of the run is not held up by it; the record says which version, when it was trained, and how many
episodes ran at once; with episode runners the held-out episodes run there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import msgspec
import pytest

from dora.config import load_config
from dora.core.orchestrator import Action, Load, Orchestrator
from dora.env import Env, Episode, Message, Task
from dora.episode import ChatRenderer
from dora.errors import ConfigError
from dora.models.tiny import char_tokenizer
from dora.protocol import Completion, Sample, SamplingParams
from dora.records import Record
from dora.serve.dispatcher import episode_limits, turn_max_tokens
from dora.serve.evaluate import Due, Evaluator
from dora.serve.placement import Placement

pytestmark = pytest.mark.timeout(30)

CAPACITY = 4


class Answer4(Env):
    def reset(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": str(task["question"])}]

    def reward(self, episode: Episode) -> float:
        return 1.0 if "4" in episode.completion else 0.0


class Sampler:
    """Answers every call with "4<|im_end|>" tagged with its lease's version."""

    def __init__(self, rollout: FakeRollout, lease_id: str) -> None:
        self.rollout, self.lease_id = rollout, lease_id

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        r = self.rollout
        r.running += 1
        r.peak = max(r.peak, r.running)
        try:
            await asyncio.sleep(0.01)
        finally:
            r.running -= 1
        version = r.orchestrator.request_version(self.lease_id)
        ids = r.tokenizer.encode("4<|im_end|>", add_special_tokens=False)
        return Completion(
            request_id=self.lease_id,
            token_ids=ids,
            logprobs=[-0.1] * len(ids),
            versions=[version] * len(ids),
            finish_reason="stop",
        )


class FakeRouter:
    def __init__(self, rollout: FakeRollout) -> None:
        self.rollout = rollout
        self.leases: set[str] = set()
        self.opened_unpinned: list[str] = []

    def open(self, lease_id: str, *, version: int, instance: str, pinned: bool = False) -> None:
        self.leases.add(lease_id)
        if not pinned:
            self.opened_unpinned.append(lease_id)

    def close(self, lease_id: str) -> bool:
        if lease_id in self.leases:
            self.leases.discard(lease_id)
            return True
        return False

    def sampler(self, lease_id: str) -> Sampler:
        return Sampler(self.rollout, lease_id)


class FakeQueue:
    newest_version: int | None = 0


class FakeMetrics:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.records: list[tuple[str, dict[str, object]]] = []

    def write(self, record: Record) -> None:
        fields = msgspec.to_builtins(record)
        self.records.append(
            (fields.pop("kind"), {**fields, "time_s": time.monotonic() - self.start})
        )


class FakeRollout:
    """What the evaluator is wired to: a real orchestrator in a real `Placement`, a fake router,
    and instant loads."""

    def __init__(self, *overrides: str) -> None:
        self.config = load_config(
            None,
            [
                f"serve.max_running={CAPACITY}",
                "rollout.group_size=4",
                "data.eval_every=1",
                *overrides,
            ],
        )
        self.tokenizer = char_tokenizer()
        self.orchestrator = Orchestrator()
        self.router = FakeRouter(self)
        self.queue = FakeQueue()
        self.metrics = FakeMetrics()
        self.tasks: list[asyncio.Task[None]] = []
        self.trained_at = {1: 1.5}
        self.running = self.peak = 0
        self.placement = Placement(
            self.orchestrator,
            self.router,  # type: ignore[arg-type]
            metrics=self.metrics,  # type: ignore[arg-type]
            spawn=self.spawn,  # type: ignore[arg-type]
        )
        self.placement.on_load = self._loaded
        self.apply(self.orchestrator.add_instance("i0", capacity=CAPACITY))

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.append(task)
        return task

    def apply(self, actions: list[Action]) -> None:
        self.placement.apply(actions)

    def _loaded(self, load: Load) -> None:
        self.queue.newest_version = load.version
        self.apply(self.orchestrator.on_loaded(load))

    def version_trained_at(self, version: int) -> float | None:
        return 0.0 if version == 0 else self.trained_at.get(version)


class FakeRunners:
    """What the evaluator needs of the runner hub: it runs each episode and returns its sample."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, str, float]] = []

    async def run_episode(self, lease_id: str, task: Task, params: SamplingParams) -> Sample:
        self.ran.append((lease_id, task.prompt_id, params.temperature))
        await asyncio.sleep(0.01)
        return Sample.build(
            token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0, 0], versions=[-1, 0],
            prompt_len=1, reward=1.0,
        )  # fmt: skip


def _evaluator(rollout: FakeRollout, n: int, runners: FakeRunners | None = None) -> Evaluator:
    tasks = [Task(f"e{i}", {"question": "2+2?"}) for i in range(n)]
    renderer = ChatRenderer(rollout.tokenizer)  # type: ignore[arg-type]
    evaluator = Evaluator(
        rollout.config.data,
        max_tokens=turn_max_tokens(rollout.config.rollout),
        limits=episode_limits(rollout.config),
        max_running=rollout.config.serve.max_running,
        placement=rollout.placement,
        newest_loaded=lambda: rollout.queue.newest_version,
        trained_at=rollout.version_trained_at,
        metrics=rollout.metrics,  # type: ignore[arg-type]
        spawn=rollout.spawn,  # type: ignore[arg-type]
        tasks=tasks,
        env_factory=Answer4,
        renderer=renderer,
        runners=runners,  # type: ignore[arg-type]
    )
    rollout.placement.listeners.append(evaluator.wake)
    return evaluator


async def test_an_evaluation_whose_version_is_superseded_before_it_finds_room() -> None:
    r = FakeRollout()
    evaluator = _evaluator(r, 6)
    group = [f"g0/{i}" for i in range(CAPACITY)]
    assert r.orchestrator.place(group, version=0) == "i0"  # the only instance is full
    evaluator.on_loaded(0)  # version 0 is due: no room for it
    await asyncio.sleep(0.05)
    assert not [k for k, _ in r.metrics.records if k == "eval"]
    r.apply(r.orchestrator.publish(1))
    for lid in group:  # the group ends; the instance loads version 1 at once
        r.apply(r.orchestrator.finish(lid))
    assert r.queue.newest_version == 1
    # the end of the run: the final version (1) is evaluated; nothing waits forever
    await asyncio.wait_for(evaluator.finish(1, timeout_s=5), 10)
    evals = [rec for kind, rec in r.metrics.records if kind == "eval"]
    assert [(e["version"], e["due"], e["n"]) for e in evals] == [(1, 0, 6)], evals
    e = evals[0]
    assert e["accuracy"] == 1.0 and e["concurrency"] == CAPACITY // 2
    assert e["version_time_s"] == 1.5 and e["started_s"] <= e["time_s"]
    assert not r.router.leases, "every evaluation lease ended"
    assert r.orchestrator.live() == {}


async def test_an_evaluation_that_starts_on_a_busy_instance_grows_to_its_share() -> None:
    r = FakeRollout()
    evaluator = _evaluator(r, 20)
    group = [f"g0/{i}" for i in range(CAPACITY)]
    r.orchestrator.place(group, version=0)
    evaluator.on_loaded(0)
    await asyncio.sleep(0.02)
    for lid in group:  # slots free one at a time, as the group's episodes end
        r.apply(r.orchestrator.finish(lid))
        await asyncio.sleep(0.02)
    await asyncio.wait_for(evaluator.finish(0, timeout_s=5), 10)
    [e] = [rec for kind, rec in r.metrics.records if kind == "eval"]
    assert (e["version"], e["n"], e["accuracy"]) == (0, 20, 1.0)
    assert e["concurrency"] == CAPACITY // 2 == r.peak, "as many at once as an idle instance gives"
    # every lease of the evaluation is pinned (mode inflight loads wait for them), every token
    # sampled by the version the record names
    assert not r.router.opened_unpinned and e["off_version_tokens"] == 0.0


async def test_success_is_counted_at_the_configured_reward_and_the_record_says_which() -> None:
    r = FakeRollout("data.eval_success_at=1.5")  # Answer4's right answer scores 1.0
    evaluator = _evaluator(r, 4)
    evaluator.on_loaded(0)
    await asyncio.wait_for(evaluator.finish(0, timeout_s=5), 10)
    [e] = [rec for kind, rec in r.metrics.records if kind == "eval"]
    assert (e["accuracy"], e["success_at"], e["reward_mean"]) == (0.0, 1.5, 1.0)


async def test_with_episode_runners_the_held_out_episodes_run_on_them() -> None:
    r = FakeRollout()
    runners = FakeRunners()
    evaluator = _evaluator(r, 6, runners)
    evaluator.on_loaded(0)
    await asyncio.wait_for(evaluator.finish(0, timeout_s=5), 10)
    [e] = [rec for kind, rec in r.metrics.records if kind == "eval"]
    assert (e["version"], e["n"], e["accuracy"]) == (0, 6, 1.0)
    assert sorted(p for _, p, _ in runners.ran) == [f"e{i}" for i in range(6)]
    assert {t for _, _, t in runners.ran} == {0.0}, "greedy, as every evaluation"
    assert r.peak == 0, "no episode ran in serve's loop"
    assert not r.router.leases, "every evaluation lease ended"


class SeededRunners(FakeRunners):
    """Solves a held-out episode only when its sampling seed is a multiple of 3."""

    def __init__(self) -> None:
        super().__init__()
        self.params: list[SamplingParams] = []

    async def run_episode(self, lease_id: str, task: Task, params: SamplingParams) -> Sample:
        self.params.append(params)
        await asyncio.sleep(0.001)
        return Sample.build(
            token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0, 0], versions=[-1, 0],
            prompt_len=1, reward=1.0 if params.seed is not None and params.seed % 3 == 0 else 0.0,
        )  # fmt: skip


async def test_at_a_temperature_k_seeded_episodes_per_task_give_avg_and_pass_at_k() -> None:
    r = FakeRollout("data.eval_temperature=0.6", "data.eval_samples=3")
    runners = SeededRunners()
    evaluator = _evaluator(r, 4, runners)  # type: ignore[arg-type]
    evaluator.on_loaded(0)
    await asyncio.wait_for(evaluator.finish(0, timeout_s=5), 10)
    [e] = [rec for kind, rec in r.metrics.records if kind == "eval"]
    # seeds 0..11, task i's repeats 3i..3i+2: exactly one of each task's three is solved
    assert sorted(p.seed for p in runners.params) == list(range(12))  # type: ignore[type-var]
    assert {p.temperature for p in runners.params} == {0.6}
    assert (e["n"], e["samples_per_task"], e["temperature"]) == (12, 3, 0.6)
    assert e["accuracy"] == pytest.approx(1 / 3) and e["pass_at_k"] == 1.0
    # a second evaluation draws the same seeds: versions compared on the same noise
    again = await asyncio.wait_for(evaluator.evaluate(0, due=Due(steps=0)), 10)
    assert sorted(p.seed for p in runners.params[12:]) == list(range(12))  # type: ignore[type-var]
    assert again.accuracy == e["accuracy"]


def test_several_greedy_samples_per_task_are_refused_naming_the_keys() -> None:
    with pytest.raises(ConfigError, match=r"data\.eval_samples = 4 .*data\.eval_temperature"):
        load_config(None, ["data.eval_samples=4"])
