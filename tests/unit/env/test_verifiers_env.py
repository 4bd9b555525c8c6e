"""envs.verifiers: a verifiers.v1 tool taskset, written as a verifiers user writes it
(tests/unit/env/verifiers_calc.py), runs through the endpoint token-exact, its weighted rewards
as components; a taskset that cannot load is a start-up error naming its key; a reward that is
NaN or not a number masks the sample with the reason."""

from __future__ import annotations

import pytest

from dora.env import Task, load_env
from dora.episode import run_episode
from dora.errors import ConfigError
from dora.protocol import SamplingParams
from tests.unit.env.exact import check_exact
from tests.unit.env.needs_verifiers import skip_unless_verifiers

skip_unless_verifiers("verifiers.v1")
pytestmark = pytest.mark.usefixtures("verifiers_on_path")

PARAMS = SamplingParams(max_tokens=200)
CALL = '<tool_call>{"name": "calculator_add", "arguments": {"a": 10, "b": 7}}</tool_call><|im_end|>'


def factory() -> object:
    return load_env(
        "envs.verifiers:VerifiersEnv", taskset="verifiers_calc", eval_taskset="verifiers_calc"
    )


async def test_verifiers_tool_taskset_episode_is_token_exact(scripted, tokenizer) -> None:
    make = factory()
    tasks = make().tasks("train")  # type: ignore[attr-defined]
    assert [t.prompt_id for t in tasks][:2] == ["train-sum0", "train-sum1"]
    assert make().tasks("test")[0].prompt_id == "test-sum0"  # type: ignore[attr-defined]
    sampler = scripted([CALL, "It is 17.<|im_end|>"])
    sample = await run_episode(
        sampler=sampler, tokenizer=tokenizer, env=make(), task=tasks[0], params=PARAMS
    )
    assert not sample.masked, sample.metadata
    assert sample.reward_components == pytest.approx({"correct": 1.0, "used_tool": 0.1})
    assert sample.num_turns == 2 and sample.num_tool_calls == 1
    check_exact(sample, sampler)
    tool_result = tokenizer.decode(sampler.prompts[1][len(sampler.prompts[0]) :])  # type: ignore[attr-defined]
    assert "17" in tool_result  # the toolset's answer, rendered after the call


@pytest.mark.parametrize(
    ("broken", "reason"),
    [("nan", "reward returned components that are not finite"), ("text", "agent raised TypeError")],
)
async def test_verifiers_reward_nan_or_text_masks_the_sample(
    scripted, tokenizer, broken: str, reason: str
) -> None:
    make = factory()
    task = make().tasks("train")[0]  # type: ignore[attr-defined]
    task = Task(task.prompt_id, {**task.data, "broken": broken})
    sample = await run_episode(
        sampler=scripted(["17<|im_end|>"]),
        tokenizer=tokenizer,
        env=make(),
        task=task,
        params=PARAMS,
    )
    assert sample.masked and sample.metadata["error"].startswith(reason), sample.metadata


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"taskset": "no_such_taskset_xyz"}, "env.kwargs.taskset = 'no_such_taskset_xyz'"),
        (
            {"taskset": "verifiers_calc", "eval_taskset": "no_such_eval_xyz"},
            "env.kwargs.eval_taskset = 'no_such_eval_xyz'",
        ),
        ({}, "name either environment .* or taskset"),
    ],
)
def test_verifiers_taskset_that_cannot_load_names_its_key(
    kwargs: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_env("envs.verifiers:VerifiersEnv", **kwargs)
