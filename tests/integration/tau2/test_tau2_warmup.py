"""The supervised warm-up teaches a tiny model built from scratch tau2's format: after warming up on
a mock task's demonstration, the model served by the real embedded engine writes tool calls that
run on tau2's database, ends its turns, and reaches the simulated user's replies, so its episodes
have several turns (what `examples/tau2/mock.toml` needs before RL; docs/tau2.md has its numbers).

One task and a small model keep the warm-up to about a minute on two quiet cores (two and a half at
load 8); the example warms up on all nine mock tasks.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

pytest.importorskip("tau2.domains.mock.environment", reason="needs the tau2 extra (docs/tau2.md)")

from dora.engine import EngineClient, EngineServer
from dora.episode import EpisodeLimits, PinnedSampler, run_group
from dora.models import TinyModelSpec, build_tiny_model
from dora.models.warmup import WarmupSettings, warmup
from dora.protocol import SamplingParams
from envs.tau2 import Tau2Env, tau2_tasks

pytestmark = pytest.mark.timeout(300)

TASK = next(t for t in tau2_tasks("mock") if t["task_id"] == "create_task_1")
ENV = functools.partial(Tau2Env, domain="mock", user="scripted", scripted_user_turns=1)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tau2-warmup")
    spec = TinyModelSpec(hidden_size=64, num_layers=2, max_position_embeddings=4096)
    base = build_tiny_model(folder / "base", spec)
    settings = WarmupSettings(steps=80, batch_size=1, lr=1.5e-2, max_len=4096, threads=2)
    return warmup(base, folder / "warm", tasks=[TASK], env_factory=ENV, settings=settings)


async def test_the_warmed_up_model_calls_tools_and_ends_its_turns(warmed: Path) -> None:
    from transformers import AutoTokenizer

    envs: list[Tau2Env] = []

    def factory() -> Tau2Env:
        envs.append(ENV())
        return envs[-1]

    async with (
        EngineServer.start(warmed, version=0, threads=2) as server,
        EngineClient(server.url, timeout_s=120) as client,
    ):
        samples = await run_group(
            sampler=PinnedSampler(client, version=server.version),
            tokenizer=AutoTokenizer.from_pretrained(warmed),
            env_factory=factory,
            task=TASK,
            group_size=4,
            # One task and 80 steps leave the call's JSON brittle at temperature 1; the example's
            # warm-up (all nine tasks, 200 steps) holds at 1 (docs/tau2.md has its numbers). At 0.3
            # 26-29 of 32 episodes went the demonstrated way (three warm-ups), so 4 of them failed
            # this test about once in a hundred runs (CI saw 1 of 4); at 0.1, 32 of 32 (two).
            params=SamplingParams(max_tokens=256, temperature=0.1),
            limits=EpisodeLimits(max_turns=4, max_total_tokens=256, context_limit=4096),
        )
    assert not any(s.masked for s in samples), [s.metadata for s in samples]

    # Sampling may spoil an episode; nearly all must go the demonstrated way: a tool call that
    # tau2 ran and that created the task in tau2's DB, then a message that ends its turn, answered
    # by the user, who stops. (A call to another tool, or with arguments tau2 refused, is spoilt.)
    def created(env: Tau2Env) -> int:
        if env.environment is None:  # never reset
            return 0
        return len(env.environment.tools.db.tasks) - 1  # the mock DB starts with one task

    outcomes = [
        (s.num_turns, s.num_tool_calls, s.finish_reason, env.termination, created(env))
        for s, env in zip(samples, envs, strict=True)
    ]
    good = [
        s
        for s, env in zip(samples, envs, strict=True)
        if s.num_tool_calls >= 1
        and s.num_turns >= 2
        and env.termination == "user_stop"
        and created(env) == 1
    ]
    assert len(good) >= 3, outcomes
    assert all(s.finish_reason == "stop" for s in good), outcomes
