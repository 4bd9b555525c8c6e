"""envs.verifiers on verifiers' classic API: an environment as a verifiers user writes one
(tests/unit/env/verifiers_calc_env.py, loaded by `vf.load_environment`), rolled out by its own
`rollout` against the episode's endpoint, token-exact, for `ToolEnv`, `MultiTurnEnv` and
`SingleTurnEnv`; its rubric's weighted functions are the components; an environment that is not
installed or whose `load_environment` raises is a start-up error naming its key; a reward that is
NaN or not a number, or a rollout that ends in a verifiers error, masks the sample with the
reason."""

from __future__ import annotations

import importlib.metadata

import pytest

from dora.env import Task, load_env
from dora.episode import EpisodeLimits, run_episode
from dora.errors import ConfigError
from dora.protocol import SamplingParams
from envs.verifiers.classic import import_verifiers, supported
from tests.unit.env.exact import check_exact
from tests.unit.env.needs_verifiers import skip_unless_verifiers

skip_unless_verifiers("verifiers")
pytestmark = pytest.mark.usefixtures("verifiers_on_path")

PARAMS = SamplingParams(max_tokens=200)
CALL = '<tool_call>{"name": "add", "arguments": {"a": 10, "b": 7}}</tool_call><|im_end|>'


def factory(**env_args: object) -> object:
    return load_env("envs.verifiers:VerifiersEnv", environment="verifiers_calc_env", **env_args)


async def episode(scripted, tokenizer, turns: list[str], task: Task | None = None, **env_args):  # type: ignore[no-untyped-def]
    make = factory(**env_args)
    task = task or make().tasks("train")[0]  # type: ignore[attr-defined]
    sampler = scripted(turns)
    sample = await run_episode(
        sampler=sampler, tokenizer=tokenizer, env=make(), task=task, params=PARAMS
    )
    return sample, sampler


async def test_verifiers_classic_tool_env_episode_is_token_exact(scripted, tokenizer) -> None:
    make = factory()
    train, test = make().tasks("train"), make().tasks("test")  # type: ignore[attr-defined]
    assert [t.prompt_id for t in train][:2] == ["train-0", "train-1"] and len(train) == 8
    assert [t.prompt_id for t in test] == ["test-0", "test-1", "test-2", "test-3"]
    sample, sampler = await episode(scripted, tokenizer, [CALL, "It is 17.<|im_end|>"])
    assert not sample.masked, sample.metadata
    assert sample.reward_components == pytest.approx({"correct": 1.0, "used_tool": 0.1})
    assert sample.num_turns == 2 and sample.num_tool_calls == 1
    check_exact(sample, sampler)
    tool_result = tokenizer.decode(sampler.prompts[1][len(sampler.prompts[0]) :])
    assert "17" in tool_result  # the environment's tool answered, rendered after the call


async def test_verifiers_classic_tool_env_several_calls_token_exact(scripted, tokenizer) -> None:
    turns = [CALL, CALL.replace('"a": 10', '"a": 17'), "10 + 7 is 17.<|im_end|>"]
    sample, sampler = await episode(scripted, tokenizer, turns, max_turns=4)
    assert not sample.masked, sample.metadata
    assert sample.num_turns == 3 and sample.num_tool_calls == 2
    check_exact(sample, sampler)


async def test_verifiers_classic_multi_turn_env_token_exact(scripted, tokenizer) -> None:
    sample, sampler = await episode(
        scripted, tokenizer, ["18<|im_end|>", "17<|im_end|>"], kind="multi"
    )
    assert not sample.masked, sample.metadata
    assert sample.num_turns == 2
    assert sample.reward_components == pytest.approx({"correct": 1.0, "used_tool": 0.0})
    check_exact(sample, sampler)
    hint = tokenizer.decode(sampler.prompts[1][len(sampler.prompts[0]) :])
    assert "Add 7 to the first number." in hint


async def test_verifiers_classic_single_turn_env(scripted, tokenizer) -> None:
    sample, sampler = await episode(scripted, tokenizer, ["17<|im_end|>"], kind="single")
    assert not sample.masked, sample.metadata
    assert sample.num_turns == 1 and sample.reward == pytest.approx(1.0)
    assert "Answer with the number only." in tokenizer.decode(sampler.prompts[0])
    check_exact(sample, sampler)


@pytest.mark.parametrize(
    ("broken", "reason"),
    [
        ("nan", "reward returned components that are not finite"),
        ("text", "agent raised TypeError: reward 'correct' returned '1.0', not a number"),
        ("", "agent raised RuntimeError: the verifiers rollout failed: EmptyModelResponseError"),
    ],
)
async def test_verifiers_classic_reward_nan_or_text_masks_the_sample(
    scripted, tokenizer, broken: str, reason: str
) -> None:
    reply = "17<|im_end|>" if broken else "<|im_end|>"  # an empty reply is a verifiers error
    sample, _ = await episode(scripted, tokenizer, [reply], kind="single", broken=broken)
    assert sample.masked and sample.metadata["error"].startswith(reason), sample.metadata


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"environment": "no_such_environment_xyz"},
            "env.kwargs.environment = 'no_such_environment_xyz': cannot load",
        ),
        (
            {"environment": "verifiers_calc_env", "no_such_arg": 1},
            "env.kwargs.environment = 'verifiers_calc_env': cannot load .*no_such_arg",
        ),
        (
            {"environment": "verifiers_calc_env", "broken": "group"},
            "not supported: reward function 'spread' scores a whole group",
        ),
        ({"environment": "verifiers_calc_env", "taskset": "x"}, "not both or neither"),
        (
            {"taskset": "verifiers_calc", "kind": "tool"},
            r"env.kwargs \['kind'\]: a verifiers taskset",
        ),
    ],
)
def test_verifiers_classic_environment_that_cannot_load_names_its_key(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_env("envs.verifiers:VerifiersEnv", **kwargs)


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.3.1", True), ("0.3.2.dev1", True), ("0.3.0", False), ("0.4.0", False), ("1.0", False)],
)
def test_verifiers_versions_outside_the_pin_are_refused(
    version: str, ok: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert supported(version) is ok
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    if ok:
        assert import_verifiers().load_environment
    else:
        with pytest.raises(ConfigError, match=f"verifiers>=0.3.1,<0.4.*found verifiers {version}"):
            import_verifiers()


async def test_verifiers_classic_call_past_the_turn_limit_masks_with_the_reason(
    scripted, tokenizer
) -> None:
    """The endpoint refuses a call past `rollout.max_turns`; verifiers ends the rollout with a
    model error: the sample is masked with the refusal's reason, never trained half-scored."""
    make = factory(max_turns=5)
    sampler = scripted([CALL])  # calls the tool every turn
    sample = await run_episode(
        sampler=sampler,
        tokenizer=tokenizer,
        env=make(),
        task=make().tasks("train")[0],  # type: ignore[attr-defined]
        params=PARAMS,
        limits=EpisodeLimits(max_turns=2),
    )
    assert len(sampler.prompts) == 2 and sample.metadata["refused: max turns"] == "1"
    assert sample.masked and sample.metadata["error"].startswith(
        "agent raised RuntimeError: the verifiers rollout failed: ModelError <- BadRequestError"
    ), sample.metadata
