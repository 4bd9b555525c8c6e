"""tau2's mock domain end to end, offline: a scripted agent (a scripted sampler through dora's real
episode runner) against a fake OpenAI-compatible user simulator on 127.0.0.1, scored by tau2's own
evaluator on tau2's real database."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import pytest

pytest.importorskip("tau2.domains.mock.environment", reason="needs the tau2 extra (docs/tau2.md)")

from aiohttp import web

from dora.env import Task
from dora.episode import ChatRenderer, EpisodeLimits, run_episode
from dora.errors import ConfigError
from dora.models.tiny import char_tokenizer
from dora.protocol import Completion, Sample, SamplingParams
from envs.tau2 import Tau2Env, tau2_tasks
from envs.tau2.chat import ChatEndpoint
from envs.tau2.judge import judge_nl_assertions
from envs.tau2.scoring import environment_factory, score, task_by_id

pytestmark = pytest.mark.timeout(60)

END = "<|im_end|>"
PARAMS = SamplingParams(max_tokens=400)
LIMITS = EpisodeLimits(max_turns=6, context_limit=30_000, max_total_tokens=4000)


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>{END}"


def say(text: str) -> str:
    return text + END


@dataclass
class FakeChatServer:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1 that answers scripted messages."""

    replies: list[str | dict[str, object]]
    requests: list[dict[str, object]] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        reply = self.replies.pop(0) if self.replies else "###STOP###"
        message = {"role": "assistant", "content": reply} if isinstance(reply, str) else reply
        return web.json_response({"choices": [{"index": 0, "message": message}]})


@pytest.fixture
async def chat_server() -> AsyncIterator[FakeChatServer]:
    server = FakeChatServer(replies=[])
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    server.url = f"http://{host}:{port}/v1"
    try:
        yield server
    finally:
        await runner.cleanup()


class ScriptedAgent:
    """A Sampler that samples the given turns, in order, with the char tokenizer."""

    def __init__(self, turns: Sequence[str]) -> None:
        self.turns = list(turns)
        self.tokenizer = char_tokenizer()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        await asyncio.sleep(0)
        text = self.turns.pop(0) if self.turns else say("...")
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        return Completion(
            request_id="r",
            token_ids=ids,
            logprobs=[-0.1] * len(ids),
            versions=[3] * len(ids),
            finish_reason=finish,  # type: ignore[arg-type]
        )


def mock_task(task_id: str) -> Task:
    return next(t for t in tau2_tasks("mock") if t["task_id"] == task_id)


async def run(env: Tau2Env, task_id: str, agent_turns: Sequence[str]) -> Sample:
    agent = ScriptedAgent(agent_turns)
    return await run_episode(
        sampler=agent,
        tokenizer=ChatRenderer(agent.tokenizer),  # type: ignore[arg-type]
        env=env,
        task=mock_task(task_id),
        params=PARAMS,
        limits=LIMITS,
    )


async def play(
    server: FakeChatServer,
    task_id: str,
    agent_turns: Sequence[str],
    user_replies: Sequence[str | dict[str, object]],
    **kwargs: object,
) -> tuple[Tau2Env, Sample]:
    server.replies = list(user_replies)
    env = Tau2Env(domain="mock", user_url=server.url, **kwargs)  # type: ignore[arg-type]
    return env, await run(env, task_id, agent_turns)


def db_tasks(env: Tau2Env) -> dict[str, dict[str, object]]:
    assert env.environment is not None
    return {k: v.model_dump() for k, v in env.environment.tools.db.tasks.items()}


OPENING = "I need a task called 'Important Meeting' for user_1."


async def test_reference_actions_score_one_and_change_the_real_database(
    chat_server: FakeChatServer,
) -> None:
    env, sample = await play(
        chat_server,
        "create_task_1",
        [
            call("create_task", user_id="user_1", title="Important Meeting"),
            say("I created the task 'Important Meeting' for you."),
        ],
        [OPENING, "Great, thanks! ###STOP###"],
        partial_credit=1.0,
    )
    assert not sample.masked, sample.metadata
    assert sample.reward_components == {"task": 1.0, "partial": 1.0}  # every check passed
    assert env.termination == "user_stop"
    assert sample.num_turns == 2 and sample.num_tool_calls == 1
    # The tool call ran on tau2's database: a fresh environment has one task, this one has two.
    fresh = environment_factory("mock")().tools.db.tasks
    assert set(fresh) == {"task_1"}
    assert db_tasks(env)["task_2"]["title"] == "Important Meeting"
    # The user simulator saw the agent's text as "user", its own as "assistant", no tool calls.
    second = cast("list[dict[str, str]]", chat_server.requests[1]["messages"])
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert "<scenario>" in second[0]["content"]
    assert second[-1]["content"] == "I created the task 'Important Meeting' for you."


async def test_user_simulator_tokens_are_never_trained(chat_server: FakeChatServer) -> None:
    _, sample = await play(
        chat_server,
        "create_task_1",
        [call("create_task", user_id="user_1", title="Important Meeting"), say("Done.")],
        [OPENING, "Thanks. ###STOP###"],
    )
    tok = char_tokenizer()
    ids, mask = sample.tokens().tolist(), sample.mask().tolist()
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])  # type: ignore[attr-defined]
    context = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])  # type: ignore[attr-defined]
    assert OPENING in context and OPENING not in trained
    assert "Important Meeting" in trained  # the agent's own tool call is trained


async def test_wrong_action_scores_zero(chat_server: FakeChatServer) -> None:
    env, sample = await play(
        chat_server,
        "create_task_1",
        [call("create_task", user_id="user_1", title="Unimportant"), say("Done.")],
        [OPENING, "Thanks. ###STOP###"],
    )
    assert not sample.masked
    assert sample.reward == 0.0
    assert db_tasks(env)["task_2"]["title"] == "Unimportant"  # it did change the database


async def test_tau2_tool_errors_reach_the_model_verbatim(chat_server: FakeChatServer) -> None:
    env, sample = await play(
        chat_server,
        "create_task_1",
        [call("create_task", user_id="nobody", title="Important Meeting"), say("Sorry.")],
        [OPENING, "Bye. ###STOP###"],
    )
    assert sample.reward == 0.0
    assert set(db_tasks(env)) == {"task_1"}
    context = char_tokenizer().decode(sample.tokens().tolist())  # type: ignore[attr-defined]
    assert "Error: User nobody not found" in context


async def test_env_assertions_task(chat_server: FakeChatServer) -> None:
    _, sample = await play(
        chat_server,
        "create_task_1_with_env_assertions",
        [call("create_task", user_id="user_1", title="Important Meeting"), say("Created.")],
        [OPENING, "Thanks ###STOP###"],
    )
    assert sample.reward == 1.0


async def test_message_history_is_continued(chat_server: FakeChatServer) -> None:
    env, sample = await play(
        chat_server,
        "update_task_with_message_history",
        [call("update_task_status", task_id="task_2", status="completed"), say("Marked done.")],
        ["Please mark that task as completed.", "Thanks ###STOP###"],
    )
    assert not sample.masked, sample.metadata
    assert sample.reward == 1.0
    # The history's create_task was replayed on the database before the episode started.
    assert db_tasks(env)["task_2"]["status"] == "completed"


async def test_transfer_and_partial_credit(chat_server: FakeChatServer) -> None:
    summary = "User wants to delete tasks."
    _, good = await play(
        chat_server,
        "impossible_task_1",
        [call("transfer_to_human_agents", summary=summary), say("Transferring you.")],
        ["Delete all my tasks.", "###TRANSFER###"],
        partial_credit=0.25,
    )
    assert good.reward == pytest.approx(1.25)
    assert good.reward_components == {"task": 1.0, "partial": 0.25}
    # Refusing without transferring keeps the database right but misses the action: 0 + half.
    _, bad = await play(
        chat_server,
        "impossible_task_1",
        [say("I cannot do that.")],
        ["Delete all my tasks.", "###STOP###"],
        partial_credit=0.25,
    )
    assert bad.reward_components == {"task": 0.0, "partial": 0.125}  # half the checks passed


async def test_agent_stop_and_turn_limit(chat_server: FakeChatServer) -> None:
    env, sample = await play(
        chat_server,
        "create_task_1",
        [call("create_task", user_id="user_1", title="Important Meeting"), say("###STOP###")],
        [OPENING],
    )
    assert env.termination == "agent_stop" and sample.reward == 1.0
    # The right action, but the conversation never ends: tau2's max-steps ending scores 0.
    env, sample = await play(
        chat_server,
        "create_task_1",
        [call("create_task", user_id="user_1", title="Important Meeting")]
        + [say("Anything else?")] * 10,
        [OPENING] + ["Hmm."] * 10,
    )
    assert sample.finish_reason == "max_turns" and sample.reward == 0.0


async def test_dead_user_simulator_masks_the_episode() -> None:
    env = Tau2Env(domain="mock", user_url="http://127.0.0.1:9/v1", timeout_s=2.0)
    env.user = ChatEndpoint(url="http://127.0.0.1:9/v1", timeout_s=2.0, retries=0)
    sample = await run(env, "create_task_1", [say("hello")])
    assert sample.masked and "reset raised" in sample.metadata["error"]


async def test_scripted_user_needs_no_endpoint() -> None:
    env = Tau2Env(domain="mock", user="scripted", scripted_user_turns=1)
    turns = [call("create_task", user_id="user_1", title="Important Meeting"), say("Created.")]
    sample = await run(env, "create_task_1", turns)
    assert sample.reward == 1.0 and sample.num_turns == 2


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="user_url"):
        Tau2Env(domain="mock")
    with pytest.raises(ConfigError, match="domain"):
        Tau2Env(domain="banking", user="scripted")
    with pytest.raises(ConfigError, match="split"):
        tau2_tasks("mock", "train")


def test_the_env_brings_its_tasks_so_env_cls_alone_names_them() -> None:
    """`data.source = "env"` (the default) reads the domain's own splits through Tau2Env.tasks."""
    from dora.config import load_config
    from dora.data import config_tasks
    from dora.env import load_env

    def tasks(*overrides: str) -> list[Task]:
        config = load_config(None, ["env.cls=envs.tau2:Tau2Env", *overrides])
        factory = load_env(config.env.cls, **config.env.kwargs)
        return config_tasks(config.data, factory)

    airline = 'env.kwargs={domain = "airline", user = "scripted"}'
    train = tasks(airline)
    assert len(train) == 30 and train[0].prompt_id.startswith("airline/")
    config = load_config(None, ["env.cls=envs.tau2:Tau2Env", airline, "data.eval_source=env"])
    factory = load_env(config.env.cls, **config.env.kwargs)
    held_out = config_tasks(config.data, factory, held_out=True)
    assert len(held_out) == 20
    assert not {t.prompt_id for t in train} & {t.prompt_id for t in held_out}
    mock = 'env.kwargs={user = "scripted"}'
    assert len(tasks(mock, "data.split=base")) == 9
    with pytest.raises(ConfigError, match="Valid splits"):
        tasks(mock)  # the mock domain has no train split
    with pytest.raises(ConfigError, match="rejected its arguments"):
        tasks(mock, "data.split=base", "data.kwargs={n = 3}")


async def test_nl_assertions_only_with_a_judge(chat_server: FakeChatServer) -> None:
    base = task_by_id("mock", "create_task_1")
    assert base.evaluation_criteria is not None
    criteria = base.evaluation_criteria.model_copy(update={"reward_basis": ["NL_ASSERTION"]})
    task = base.model_copy(update={"evaluation_criteria": criteria})
    skipped = score(domain="mock", task=task, trajectory=[], nl_met=None)
    assert skipped.nl_skipped and skipped.reward == 1.0
    judged = score(domain="mock", task=task, trajectory=[], nl_met=[False])
    assert judged.reward == 0.0 and judged.breakdown["NL_ASSERTION"] == 0.0

    outcome = "The agent confirmed the task was created successfully"
    verdict = {"results": [{"expectedOutcome": outcome, "reasoning": "ok", "metExpectation": True}]}
    chat_server.replies = [f"```json\n{json.dumps(verdict)}\n```"]
    met = await judge_nl_assertions(ChatEndpoint(url=chat_server.url), [], [outcome])
    assert met == [True]


async def test_telecom_user_simulator_runs_its_own_tools(chat_server: FakeChatServer) -> None:
    task = tau2_tasks("telecom", "small")[0]
    tool_call = {
        "id": "u1",
        "type": "function",
        "function": {"name": "toggle_roaming", "arguments": "{}"},
    }
    chat_server.replies = [
        "My mobile data does not work abroad.",
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        "I turned roaming on, it works now. ###STOP###",
    ]
    env = Tau2Env(domain="telecom", user_url=chat_server.url, partial_credit=1.0)
    agent = ScriptedAgent([say("Please turn on data roaming in your phone settings.")])
    sample = await run_episode(
        sampler=agent,
        tokenizer=ChatRenderer(agent.tokenizer),  # type: ignore[arg-type]
        env=env,
        task=task,
        params=PARAMS,
        limits=EpisodeLimits(max_turns=3, context_limit=60_000, max_total_tokens=4000),
    )
    assert not sample.masked, sample.metadata
    # The first request offered the user its phone tools; the third saw the tool's result.
    offered = cast("list[dict[str, dict[str, str]]]", chat_server.requests[0]["tools"])
    assert any(t["function"]["name"] == "toggle_roaming" for t in offered)
    third = cast("list[dict[str, str]]", chat_server.requests[2]["messages"])
    assert third[-1]["role"] == "tool" and third[-1]["tool_call_id"] == "u1"
    assert env.environment is not None and env.environment.user_tools.db.device.roaming_enabled
    assert env.termination == "user_stop"
    # Roaming on is one of the task's env assertions, so partial progress shows in the checks.
    assert 0.0 < sample.reward_components["partial"] <= 1.0


async def test_the_user_simulator_keeps_one_session_that_close_ends(
    chat_server: FakeChatServer,
) -> None:
    env, sample = await play(
        chat_server,
        "create_task_1",
        [call("create_task", user_id="user_1", title="Important Meeting"), say("Done.")],
        [OPENING, "Thanks. ###STOP###"],
    )
    assert not sample.masked and len(chat_server.requests) == 2
    assert env._session is None  # the runner awaited close(), which closed the session
    env = Tau2Env(domain="mock", user_url=chat_server.url)
    chat_server.replies = [OPENING]
    await env.reset(mock_task("create_task_1"))
    session = env._session
    assert session is not None and not session.closed
    await env.close()
    assert session.closed


async def test_demonstrations_are_multi_turn_episodes_that_solve_the_tasks() -> None:
    from dora.models.warmup import render_examples

    tokenizer = char_tokenizer()
    factory = functools.partial(Tau2Env, domain="mock", user="scripted")
    tasks = tau2_tasks("mock")
    examples = await asyncio.to_thread(render_examples, tokenizer, factory, tasks)
    rewards = {}
    for task, segments in zip(tasks, examples, strict=True):
        assert segments is not None
        turns = [tokenizer.decode(ids) for ids, trained in segments if trained]  # type: ignore[attr-defined]
        env = factory()
        sample = await run_episode(
            sampler=ScriptedAgent(turns),
            tokenizer=ChatRenderer(tokenizer),  # type: ignore[arg-type]
            env=env,
            task=task,
            params=PARAMS,
            limits=LIMITS,
        )
        # The runner rebuilds the warm-up's sequence token for token, loss mask included.
        assert sample.tokens().tolist() == [t for ids, _ in segments for t in ids]
        assert sample.mask().tolist() == [int(m) for ids, m in segments for _ in ids]
        assert env.termination == "user_stop" and sample.num_turns >= 2
        rewards[task["task_id"]] = (sample.reward, sample.num_tool_calls)
    # Every task with reference actions makes its calls; the reference solves these tasks.
    assert rewards["create_task_1"] == (1.0, 1)
    assert rewards["update_task_with_message_history"] == (1.0, 1)
    assert rewards["impossible_task_1"] == (1.0, 1)
    assert sum(r for r, _ in rewards.values()) >= 6, rewards
