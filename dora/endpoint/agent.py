"""Agents that bring their own loop: an environment whose episode is a user's function talking to
an OpenAI-compatible endpoint that serve gives it.

The function is plain async code, e.g. with the `openai` client:

    async def solve(base_url: str, model: str, task: Task, **kwargs) -> float | dict[str, float]

It gets the episode's base URL (`http://127.0.0.1:<port>/<token>/v1`), the model name to ask for
and the task (`task["question"]`; plus the config's `env.kwargs`), runs its loop (tools, several
turns, its own history) and returns the reward (a number, or named components whose sum is the
reward, as `Env.reward`). `env.cls = "module:solve"` names it; `agent_env(solve, tasks=...)` makes
it an `Env` class explicitly (with tasks of its own), and `AgentEnv` can be subclassed instead.
A synchronous function runs in the episode's worker thread (it may use `openai.OpenAI`).

What the sample is, call by call, is in `dora.endpoint.record`; what a request may set in
`dora.endpoint.requests`. The outcomes that mask the sample, each with its reason: the agent
raised (`agent raised ...`), it made no model call (`agent made no model call`), it returned a
reward that is not a finite number (`reward returned ...`), the instance ended a call, the episode
ran past `env.episode_timeout_s` (the agent's deadline; none by default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dora.endpoint.server import acquire
from dora.endpoint.session import Session
from dora.env import AgentEnv, Task, agent_env
from dora.episode_guard import EnvFailure, Hooks, reward_total
from dora.protocol import Sample, SamplingParams
from dora.render import ChatRenderer

if TYPE_CHECKING:
    from dora.episode import EpisodeLimits, Sampler

__all__ = ["AgentEnv", "agent_env", "run_agent_episode"]

MODEL = "policy"
"""The model name an agent is given and must ask for."""
NO_DEADLINE_S = 1e9


async def run_agent_episode(
    *,
    sampler: Sampler,
    renderer: ChatRenderer,
    env: AgentEnv,
    hooks: Hooks,
    task: Task,
    params: SamplingParams,
    limits: EpisodeLimits,
) -> Sample:
    """One episode of an agent: its endpoint open while `env.agent` runs, then its sample."""
    session = Session(sampler=sampler, renderer=renderer, params=params, limits=limits, model=MODEL)
    where = f"(env {type(env).__name__}, task {task.prompt_id})"
    server = await acquire()
    try:
        token = server.open(session)
        try:
            raw = await hooks.call(
                "agent",
                env.agent,
                server.base_url(token),
                MODEL,
                task,
                timeout_s=limits.episode_timeout_s or NO_DEADLINE_S,
            )
        finally:
            await server.close(token)
        if session.error is not None:
            raise session.error  # a dead server: serve's business, as in the episode runner
        reward, components = _outcome(session, raw)
    except EnvFailure as failure:
        if session.error is not None:
            raise session.error from failure
        finish = "abort" if session.failure else failure.finish_reason
        return session.record.to_sample(
            reward=0.0,
            masked=True,
            finish_reason=finish,
            metadata={"prompt_id": task.prompt_id, "error": f"{failure} {where}"},
        )
    finally:
        server.release()
    return session.record.to_sample(
        reward=reward,
        reward_components=components,
        finish_reason=session.finish,
        metadata={"prompt_id": task.prompt_id},
    )


def _outcome(session: Session, raw: object) -> tuple[float, dict[str, float]]:
    if session.failure is not None:
        raise EnvFailure(session.failure, "abort")
    if not session.record.calls:
        raise EnvFailure("agent made no model call: nothing to train on")
    try:
        return reward_total(raw)
    except (TypeError, ValueError) as exc:
        raise EnvFailure(f"reward returned {exc}") from exc
