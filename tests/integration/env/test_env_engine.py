"""The tutorial's environment, copied from docs/environments.md as a new user would, runs through
the episode runner against the real embedded engine serving a tiny model.

The tiny model is randomly initialised, so it writes noise, not tool calls. To still exercise many
turns, every letter, digit and space is a stop token: each turn is a token or two, finishes with
"stop" without `<|im_end|>` (so the runner closes the turn itself), goes to `step`, and gets a
reply, until `max_turns`. Whatever the model writes, the sample must be exact: the tokens each
request continued are a prefix of the final sequence, the masked tokens are exactly what the engine
returned, with its log-probs and its version.
"""

from __future__ import annotations

import re
import string
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from dora.env import Env, Task
from dora.episode import EpisodeLimits, PinnedSampler, run_group
from dora.protocol import Completion, SamplingParams

engine = pytest.importorskip("dora.engine")

pytestmark = pytest.mark.timeout(120)

DOC = Path(__file__).resolve().parents[3] / "docs" / "environments.md"


def tutorial_env() -> type[Env]:
    block = re.search(r"<!-- tutorial.*?-->\n```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert block is not None
    namespace: dict[str, object] = {"__name__": "tutorial"}
    exec(compile(block.group(1), str(DOC), "exec"), namespace)
    return namespace["GuessEnv"]  # type: ignore[return-value]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dora.models.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("env-engine") / "tiny", TinyModelSpec(seed=0))


@pytest.fixture
async def served(tiny_model: Path) -> AsyncIterator[tuple[object, object]]:
    async with (
        engine.EngineServer.start(tiny_model, version=0, threads=1) as server,
        engine.EngineClient(server.url, timeout_s=60) as client,
    ):
        yield server, client


class Recording:
    """Wraps a Sampler and keeps what went in and came out."""

    def __init__(self, inner: PinnedSampler) -> None:
        self.inner = inner
        self.calls: list[tuple[list[int], Completion]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        completion = await self.inner.generate(prompt_ids, params)
        self.calls.append((list(prompt_ids), completion))
        return completion


async def test_tutorial_env_runs_against_the_embedded_engine(tiny_model, served) -> None:
    from transformers import AutoTokenizer

    server, client = served
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    stops = tokenizer.convert_tokens_to_ids(list(string.ascii_letters + string.digits + " "))
    GuessEnv = tutorial_env()
    sampler = Recording(PinnedSampler(client, version=server.version))
    samples = await run_group(
        sampler=sampler,
        tokenizer=tokenizer,
        env_factory=lambda: GuessEnv(high=10),
        task=Task("game-1"),
        group_size=2,
        params=SamplingParams(max_tokens=8, temperature=1.0, stop_token_ids=stops, seed=0),
        limits=EpisodeLimits(max_turns=3, tool_timeout_s=5),
    )
    assert len(samples) == 2
    for sample in samples:
        assert not sample.masked, sample.metadata.get("error")
        assert sample.finish_reason in ("stop", "max_turns", "length")
        tokens = sample.tokens().tolist()
        mask = sample.mask()
        # This episode's requests: each continued a prefix of the final sequence with exactly
        # the tokens the engine returned (two identical episodes share them, hence the dict).
        mine = sorted(
            {
                tuple(p): c
                for p, c in sampler.calls
                if tokens[: len(p) + len(c.token_ids)] == p + list(c.token_ids)
            }.items(),
            key=lambda item: len(item[0]),
        )
        assert len(mine) == sample.num_turns >= 1
        sampled = [t for _, c in mine for t in c.token_ids]
        assert np.asarray(tokens)[mask == 1].tolist() == sampled
        logprobs = sample.behaviour_logprobs()[mask == 1]
        np.testing.assert_allclose(logprobs, [lp for _, c in mine for lp in c.logprobs], rtol=1e-6)
        assert (logprobs < 0).all() and (sample.token_versions()[mask == 1] == 0).all()
        assert set(sample.reward_components) == {"solved", "spared"}
    multi = [s for s in samples if s.num_turns > 1]
    assert multi, "stop tokens end every turn early, so episodes go on to step()"
    text = tokenizer.decode(multi[0].tokens().tolist())
    assert "Keep guessing with the guess tool." in text


async def test_chain_arithmetic_group_against_the_embedded_engine(tiny_model, served) -> None:
    from transformers import AutoTokenizer

    from dora.env import load_env
    from envs.math import chain_arithmetic_tasks

    server, client = served
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    task = chain_arithmetic_tasks(1, seed=0)[0]
    samples = await run_group(
        sampler=PinnedSampler(client, version=server.version),
        tokenizer=tokenizer,
        env_factory=load_env("envs.math:ChainArithmeticEnv"),
        task=task,
        group_size=4,
        params=SamplingParams(max_tokens=12),
    )
    assert len({s.prompt_len for s in samples}) == 1
    prompt = samples[0].tokens()[: samples[0].prompt_len]
    for sample in samples:
        assert not sample.masked and sample.reward in (0.0, 1.0)
        np.testing.assert_array_equal(sample.tokens()[: sample.prompt_len], prompt)
        assert sample.mask()[: sample.prompt_len].sum() == 0
        assert 1 <= sample.mask().sum() <= 12 and sample.num_turns == 1
