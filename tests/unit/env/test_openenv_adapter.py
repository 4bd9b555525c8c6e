"""`envs.openenv.OpenEnvEnv` against a real OpenEnv server on 127.0.0.1: the word game of
`tests/openenv_words.py`, an `Environment` served by OpenEnv's own `create_fastapi_app` and
reached through OpenEnv's own WebSocket client. Episodes run in dora's episode runner on a
scripted sampler, so each turn's text, and so each action and reward, is known."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openenv")  # the `openenv` extra; CI installs it

import openenv_words
from openenv_words import STEP_REWARD, TwoTextAction, WordEnvironment, make_app

from dora import (
    ConfigError,
    EnvError,
    EpisodeLimits,
    SamplingParams,
    Task,
    load_env,
    run_episode,
    run_group,
)
from envs.openenv import LocalApp, OpenEnvEnv, observation_text, reset_kwargs, text_field

pytestmark = pytest.mark.timeout(120)

END = "<|im_end|>"
PARAMS = SamplingParams(max_tokens=40)
GO = Task("train-0", {"seed": 0})  # seed 0: the word is "go"
SPEC = "envs.openenv:OpenEnvEnv"


@pytest.fixture(scope="module")
def word_server() -> Iterator[tuple[str, list[WordEnvironment]]]:
    app, log = make_app()
    local = LocalApp(app, name="openenv-test")
    try:
        yield local.url, log
    finally:
        local.close()


@pytest.fixture
def served() -> Iterator[Any]:
    """Serve another app for one test: `served(app) -> url`."""
    started: list[LocalApp] = []

    def serve(app: object) -> str:
        started.append(LocalApp(app, name="openenv-test"))
        return started[-1].url

    yield serve
    for local in started:
        local.close()


def factory(url: str, **kwargs: object) -> Any:
    return load_env(SPEC, url=url, **kwargs)


async def play(env: Any, sampler: Any, *, max_turns: int = 8, task: Task = GO) -> Any:
    return await run_episode(
        sampler=sampler,
        tokenizer=sampler.tokenizer,
        env=env,
        task=task,
        params=PARAMS,
        limits=EpisodeLimits(max_turns=max_turns),
    )


def session_of(log: list[WordEnvironment], before: int) -> WordEnvironment:
    """The one session opened since the log had `before` entries."""
    new = log[before:]
    assert len(new) == 1, [s.messages for s in new]
    return new[0]


async def test_openenv_episode_is_one_session_reset_step_and_summed_rewards(
    word_server, scripted
) -> None:
    url, log = word_server
    before = len(log)
    sampler = scripted(["no" + END, "go" + END])
    sample = await play(factory(url)(), sampler)
    assert not sample.masked and sample.num_turns == 2 and sample.finish_reason == "stop"
    session = session_of(log, before)
    assert session.seed == 0 and session.messages == ["no", "go"]
    assert sample.reward == sum(session.rewards) == STEP_REWARD + (STEP_REWARD + 1.0)
    assert session.closed  # close() ended the session: the server dropped its Environment
    first, second = (sampler.tokenizer.decode(p) for p in sampler.prompts)
    assert "Say go." in first and second.endswith("No. Say go.<|im_end|>\n<|im_start|>assistant\n")


async def test_openenv_reward_mode_last_and_an_episode_cut_by_dora(word_server, scripted) -> None:
    url, log = word_server
    before = len(log)
    sample = await play(factory(url, reward_mode="last")(), scripted(["no" + END, "go" + END]))
    assert sample.reward == STEP_REWARD + 1.0
    # Cut by max_turns before the game is done: the reward is what the steps that ran earned.
    before = len(log)
    sample = await play(factory(url)(), scripted(["no" + END]), max_turns=2)
    session = session_of(log, before)
    assert not sample.masked and sample.num_turns == 2 and 1 <= len(session.rewards) <= 2
    assert sample.reward == STEP_REWARD * len(session.rewards)


async def test_openenv_step_that_fails_on_the_server_masks_the_sample_with_its_reason(
    word_server, scripted
) -> None:
    url, log = word_server
    before = len(log)
    sample = await play(factory(url)(), scripted(["boom" + END]))
    assert sample.masked and sample.reward == 0.0
    error = sample.metadata["error"]
    assert error.startswith("step raised EnvError") and f"OpenEnv step at {url}" in error
    assert "the word environment blew up" in error and "EXECUTION_ERROR" in error
    assert session_of(log, before).closed


async def test_openenv_sessions_past_the_servers_capacity_fail_or_wait_for_max_sessions(
    served,
) -> None:
    url = served(make_app(max_sessions=1)[0])
    first = factory(url)()
    await first.reset(GO)
    for _ in range(3):  # the server's refusal comes before or after the client's first message
        second = factory(url)()
        try:
            with pytest.raises(EnvError, match=r"at capacity: 1/1 .*CAPACITY_REACHED"):
                await second.reset(GO)
        finally:
            await second.close()
    await first.close()

    make = factory(url, max_sessions=1)
    first, second = make(), make()
    await first.reset(GO)
    waiting = asyncio.create_task(second.reset(GO))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # it waits for a session instead of failing
    await first.close()
    assert (await asyncio.wait_for(waiting, 30))[0]["content"] == "Say go."
    await second.close()


async def test_openenv_group_runs_its_episodes_on_sessions_of_their_own(
    word_server, scripted, caplog
) -> None:
    url, log = word_server
    before = len(log)
    sampler = scripted(["go" + END])
    samples = await run_group(
        sampler=sampler,
        tokenizer=sampler.tokenizer,
        env_factory=factory(url),
        task=Task("train-4", {"seed": 4, "reset": {"episode_id": "e4"}}),
        group_size=8,
        params=PARAMS,
    )
    sessions = log[before:]
    assert len(sessions) == 8 and all(s.seed == 4 and s.closed for s in sessions)
    assert [s.reward for s in samples] == [STEP_REWARD + 1.0] * 8  # seed 4: the word is "go"
    # Sessions end cleanly: the server closes the connection first (OpenEnv 0.3's server logs a
    # traceback when the client closes its side before it does).
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


async def test_openenv_app_is_served_in_the_process_and_hooks_shape_prompts_and_actions(
    scripted,
) -> None:
    make = load_env(
        SPEC,
        app="openenv_words:app",
        action="openenv_words:shout",
        prompt="openenv_words:with_turn",
        system_prompt="Play.",
    )
    server = make.keywords["server"]  # type: ignore[attr-defined]
    try:
        before = len(openenv_words.sessions)
        sampler = scripted(["go" + END])
        sample = await play(make(), sampler)
        session = session_of(openenv_words.sessions, before)
        assert session.messages == ["GO"] * 3  # "GO" is not "go": three misses end the game
        assert sample.reward == STEP_REWARD * 3
        prompt = sampler.tokenizer.decode(sampler.prompts[0])
        assert "Play." in prompt and "[turn 0] Say go." in prompt
    finally:
        server.close()


async def test_openenv_plain_text_episodes_and_a_typed_action_class(word_server, scripted) -> None:
    url, _ = word_server
    env = factory(url, chat=False, action_cls="openenv_words:WordAction", system_prompt="Play.")()
    assert await env.reset(GO) == "Play.\n\nSay go."
    reply, done = await env.step("no")
    assert reply == "\nNo. Say go.\n" and not done
    assert (await env.step("go"))[1]
    assert env.reward(None) == STEP_REWARD * 2 + 1.0  # type: ignore[arg-type]
    await env.close()


async def test_openenv_built_directly_resolves_and_releases_its_own_server(scripted) -> None:
    env = OpenEnvEnv(app="openenv_words:app")
    sample = await play(env, scripted(["go" + END]))
    assert not sample.masked and sample.reward == STEP_REWARD + 1.0
    assert env._server is not None and env._server.local is None  # closed with the episode


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def not_openenv(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that is not an OpenEnv server: 404 for everything."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"no"})


def test_openenv_start_up_errors_name_the_key(word_server, served) -> None:
    url, _ = word_server
    cases: list[tuple[dict[str, object], str]] = [
        ({"url": refused_url()}, r"env.kwargs.url=.*no OpenEnv server answers at"),
        ({"url": served(not_openenv)}, r"env.kwargs.url=.*answered HTTP 404"),
        ({"url": "127.0.0.1:8000"}, r"env.kwargs.url=.*use an http://"),
        ({}, r"exactly one of url .* and app"),
        ({"url": url, "app": "openenv_words:app"}, r"exactly one of url"),
        ({"app": "no_such_module:app"}, r"env.kwargs.app='no_such_module:app': cannot import"),
        ({"app": "openenv_words:WordEnvironment"}, r"env.kwargs.app=.*not an ASGI app"),
        ({"url": url, "action_cls": "openenv_words:Nope"}, r"env.kwargs.action_cls=.*no attr"),
        ({"url": url, "action_cls": "openenv_words:make_app"}, r"not an OpenEnv Action class"),
        ({"url": url, "action": "openenv_words:nope"}, r"env.kwargs.action='openenv_words:nope'"),
        ({"url": url, "action_field": "text"}, r"env.kwargs.action_field='text'.*message"),
        ({"url": url, "reward_mode": "mean"}, r"env.kwargs.reward_mode='mean'"),
        ({"url": url, "max_sessions": -1}, r"env.kwargs.max_sessions=-1"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ConfigError, match=match):
            load_env(SPEC, **kwargs)
    two = served(make_app(action_cls=TwoTextAction)[0])
    with pytest.raises(ConfigError, match=r"several text fields \(message, note\).*action_field"):
        load_env(SPEC, url=two)


def test_openenv_tasks_reset_arguments_and_observation_text() -> None:
    env = OpenEnvEnv(url="http://127.0.0.1:1")  # builds without touching the server
    train, test = env.tasks("train", n=3), env.tasks("test", n=2)
    assert [t.data["seed"] for t in train] == [0, 1, 2]
    assert [t.data["seed"] for t in test] == [1_000_000, 1_000_001]
    # data.seed draws other episodes, in training and held out alike, never another seed's
    seeds = {s: env.tasks("train", n=3, seed=s) + env.tasks("test", n=2, seed=s) for s in (0, 1, 2)}
    drawn = [t.data["seed"] for tasks in seeds.values() for t in tasks]
    assert len(set(drawn)) == len(drawn) == 15
    with pytest.raises(ConfigError, match=r"data\.seed"):
        env.tasks("train", n=3, seed=5000)
    assert reset_kwargs(Task("a", {"seed": 4, "reset": {"level": 2}})) == {"seed": 4, "level": 2}
    assert reset_kwargs(Task("a")) == reset_kwargs(Task("a", {"seed": -1}))  # from the id
    with pytest.raises(EnvError, match="not a mapping"):
        reset_kwargs(Task("a", {"reset": [1]}))
    assert observation_text({"prompt": "hi", "turn": 2}) == "hi"
    assert observation_text({"a": "x", "b": "y"}) == '{"a": "x", "b": "y"}'
    assert observation_text({"prompt": "hi", "turn": 2}, field="turn") == "2"
    with pytest.raises(EnvError, match="no field 'board'"):
        observation_text({"prompt": "hi"}, field="board")


def test_openenv_text_field_of_an_action_schema() -> None:
    schema = TwoTextAction.model_json_schema()
    nullable = {"properties": {"text": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
    assert text_field(nullable, key="k") == "text"
    assert text_field({**schema, "required": ["note"]}, key="k") == "note"
    with pytest.raises(ConfigError, match="no text field"):
        text_field({"properties": {"n": {"type": "integer"}}}, key="k")
