"""The environment's `close()` hook: awaited once at the end of every episode, however it ends."""

from __future__ import annotations

import asyncio

import pytest

from dora.env import Env, Episode, Message, Task
from dora.episode import EpisodeLimits, run_episode, run_group
from dora.errors import ServerUnavailable
from dora.models.tiny import char_tokenizer
from dora.protocol import Completion, SamplingParams

pytestmark = pytest.mark.timeout(30)

END = "<|im_end|>"
PARAMS = SamplingParams(max_tokens=50)
TASK = Task("t0", {"question": "hi"})
TOKENIZER = char_tokenizer()


class ClosingEnv(Env):
    """Counts `close()` calls; `fail` names the hook that raises."""

    def __init__(self, fail: str = "", close_error: bool = False, close_s: float = 0.0) -> None:
        self.fail = fail
        self.close_error = close_error
        self.close_s = close_s
        self.closed = 0
        self.close_finished = False

    def reset(self, task: Task) -> list[Message]:
        if self.fail == "reset":
            raise RuntimeError("reset failed")
        return [{"role": "user", "content": str(task["question"])}]

    def step(self, messages: list[Message] | str) -> tuple[list[Message], bool]:
        if self.fail == "step":
            raise RuntimeError("step failed")
        return [], True

    def reward(self, episode: Episode) -> float:
        return 1.0

    async def close(self) -> None:
        self.closed += 1
        await asyncio.sleep(self.close_s)
        if self.close_error:
            raise RuntimeError("close failed")
        self.close_finished = True


async def episode(env: Env, sampler: object, limits: EpisodeLimits | None = None) -> object:
    return await run_episode(
        sampler=sampler,  # type: ignore[arg-type]
        tokenizer=TOKENIZER,  # type: ignore[arg-type]
        env=env,
        task=TASK,
        params=PARAMS,
        limits=limits,
    )


async def test_close_runs_once_after_a_normal_episode(scripted) -> None:
    env = ClosingEnv()
    sample = await episode(env, scripted(["hello" + END]))
    assert not sample.masked and sample.reward == 1.0  # type: ignore[attr-defined]
    assert env.closed == 1 and env.close_finished


@pytest.mark.parametrize("hook", ["reset", "step"])
async def test_close_runs_once_after_an_environment_error(scripted, hook: str) -> None:
    env = ClosingEnv(fail=hook)
    sample = await episode(env, scripted(["hello" + END]))
    assert sample.masked and f"{hook} raised" in sample.metadata["error"]  # type: ignore[attr-defined]
    assert env.closed == 1


async def test_close_runs_when_the_sampler_fails_and_the_error_propagates() -> None:
    class DeadServer:
        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
            raise ServerUnavailable("instance died")

    env = ClosingEnv()
    with pytest.raises(ServerUnavailable):
        await episode(env, DeadServer())
    assert env.closed == 1


async def test_close_runs_when_the_episode_is_cancelled_and_cancellation_propagates() -> None:
    started = asyncio.Event()

    class Hanging:
        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
            started.set()
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

    env = ClosingEnv(close_s=0.05)  # close awaits something while the task is being cancelled
    task = asyncio.create_task(episode(env, Hanging()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert env.closed == 1 and env.close_finished


async def test_a_failing_or_hanging_close_is_logged_and_leaves_the_sample_alone(
    scripted, caplog: pytest.LogCaptureFixture
) -> None:
    failing = ClosingEnv(close_error=True)
    sample = await episode(failing, scripted(["hello" + END]))
    assert not sample.masked and sample.reward == 1.0  # type: ignore[attr-defined]
    assert failing.closed == 1
    assert "close() of prompt 't0' failed: close raised RuntimeError" in caplog.text

    hanging = ClosingEnv(close_s=60.0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    sample = await episode(hanging, scripted(["hello" + END]), EpisodeLimits(close_timeout_s=0.1))
    assert loop.time() - began < 5.0 and not sample.masked  # type: ignore[attr-defined]
    assert hanging.closed == 1 and not hanging.close_finished
    assert "close() of prompt 't0' failed: close timed out after 0.1 s" in caplog.text


async def test_every_episode_of_a_group_closes_its_own_env(scripted) -> None:
    envs: list[ClosingEnv] = []

    def factory() -> ClosingEnv:
        envs.append(ClosingEnv(fail="step" if len(envs) == 1 else ""))
        return envs[-1]

    samples = await run_group(
        sampler=scripted(["hello" + END]),
        tokenizer=TOKENIZER,  # type: ignore[arg-type]
        env_factory=factory,
        task=TASK,
        group_size=3,
        params=PARAMS,
    )
    # the factories run at once, in threads of their own: which episode got the failing env
    # is not fixed, only that one did
    assert sorted(s.masked for s in samples) == [False, False, True]
    assert [e.closed for e in envs] == [1, 1, 1]
