"""A scripted sampler: returns predetermined turns, so episode tokens can be checked exactly."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from dora.models.tiny import char_tokenizer
from dora.protocol import Completion, SamplingParams


class ScriptedSampler:
    """Returns the given turns in order, tokenized with the char tokenizer (test-only fake).

    A turn is sampled text; `logprob(i)` is the behaviour log-prob of the i-th sampled token
    overall, so tests can check that every log-prob lands on the right token. `prompts` records what
    it got.
    """

    def __init__(self, tokenizer: object, turns: Sequence[str], *, version: int = 7) -> None:
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.version = version
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.sampled: list[list[int]] = []
        self._count = 0

    @staticmethod
    def logprob(i: int) -> float:
        return -0.001 * (i + 1)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        await asyncio.sleep(0)
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        text = self.turns[min(len(self.prompts) - 1, len(self.turns) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        self.sampled.append(ids)
        logprobs = [self.logprob(self._count + i) for i in range(len(ids))]
        self._count += len(ids)
        return Completion(
            request_id=f"r{len(self.prompts)}",
            token_ids=ids,
            logprobs=logprobs,
            versions=[self.version] * len(ids),
            finish_reason=finish,  # type: ignore[arg-type]
        )


@pytest.fixture(scope="session")
def tokenizer() -> object:
    return char_tokenizer()


@pytest.fixture
def scripted(tokenizer: object) -> type[ScriptedSampler]:
    class Bound(ScriptedSampler):
        def __init__(self, turns: Sequence[str], *, version: int = 7) -> None:
            super().__init__(tokenizer, turns, version=version)

    return Bound


@pytest.fixture
def verifiers_on_path() -> Iterator[None]:
    """This folder on `sys.path` for the verifiers environment and taskset written here as their
    users write them (imported by module name, as verifiers imports them), unloaded after."""
    here = str(Path(__file__).parent)
    sys.path.insert(0, here)
    yield
    sys.path.remove(here)
    for name in ("verifiers_calc", "verifiers_calc_env"):
        sys.modules.pop(name, None)
