"""The episode runner: one environment episode, token in and token out, as one training `Sample`.

Invariants (docs/environments.md, "How an episode becomes a training sample"):

- The conversation is kept as token ids. The model's sampled tokens are appended exactly as sampled
  and never re-tokenized; re-rendering chat history and tokenizing it again silently changes tokens
  (merged BPE pieces, normalised JSON or whitespace in tool calls) and makes the behaviour log-probs
  belong to a different sequence.
- Prompts and new messages are rendered by `dora.render.ChatRenderer`: a plain-text prompt is
  `tokenizer(prompt)`'s ids; new environment messages are rendered behind a fixed probe
  conversation, never behind the real history, and the template's end-of-turn text that the model
  did not sample is appended. With this, the tokens equal the chat-template rendering of the whole
  conversation whenever the model writes its turns in the template's own format
  (tests/unit/env/test_env_episode.py checks it).
- `loss_mask` is 1 exactly on sampled tokens, which carry their behaviour log-prob and version;
  every other token has mask 0, log-prob 0 and version -1.
- Environment hooks (`reset`, `tools`, `step`, `reward`, `close`) never run synchronous code on the
  event loop: a synchronous hook runs in a thread of the episode's own (`dora.hooks`), and every
  hook has a deadline (`step_timeout_s` for `reset`, `tools` and `step`, `reward_timeout_s`,
  `close_timeout_s`), the episode one more (`episode_timeout_s`).
- Environment errors (a hook that raises, overruns its deadline or returns what cannot be used;
  an empty prompt; text the tokenizer refuses, such as a lone surrogate) never propagate: the
  sample is masked, the error is logged and put in `metadata["error"]`, whose head names the hook
  and what went wrong (`reward timed out after 60 s`, the reason serve counts) and whose tail
  names the environment class and the task. Sampler errors (a dead server) do propagate: the serve
  side owns that policy. Cancellation always propagates.
- Limits: `max_turns` model turns, `max_total_tokens` sampled tokens over all turns, `context_limit`
  tokens in the whole sequence; environment tokens that would cross the context limit are not
  appended and the episode stops with finish reason "context". A turn cut off by a token limit
  ends the episode ("length"): continuing after half a turn would train on a broken conversation.
- `env.close()` is awaited once at the end of every episode the runner runs, however it ended (a
  normal end, an environment error, a sampler error, cancellation), bounded by `close_timeout_s`;
  a failing `close` is logged and does not change the sample (its data is complete by then).
- Tool calls are parsed only when the env offers tools (a single-turn env stays single-turn whatever
  the model writes). Tool calls of one turn run one after another, in the order written (tools may
  share state on the env object); malformed calls are answered after them. A tool that returns
  `EndEpisode` ends the episode after its call ("stop"); the calls after it do not run.
- `step` receives the messages new since the environment last spoke (reset's prompt or its last
  reply): the model's turns with their tool calls and tool results, ending with the turn that
  called no tool; in a plain-text episode, the model's turn. `Episode.messages` is the whole
  conversation.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, cast

import msgspec

from dora.endpoint.agent import AgentEnv, run_agent_episode
from dora.env import Env, Episode, Message, Task
from dora.episode_guard import (
    SAMPLER_ENDED,
    EnvFailure,
    Hooks,
    check_reply,
    guarded,
    reward_total,
)
from dora.errors import EnvError
from dora.instance.callcpu import CALL_CPU
from dora.instance.interface import InstanceClient
from dora.protocol import Completion, FinishReason, Sample, SamplingParams, TokenSequence
from dora.render import ChatRenderer
from dora.tools import ParsedTurn, ToolBox, ToolResult, parse_tool_calls

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ChatRenderer",
    "EpisodeLimits",
    "GroupFailed",
    "InstanceClient",
    "PinnedSampler",
    "Sampler",
    "masked_sample",
    "run_episode",
    "run_fresh_episode",
    "run_group",
]

log = logging.getLogger("dora.env")

ErrorPolicy = Literal["mask", "retry"]


class Sampler(Protocol):
    """An LLM pinned to one weight version: token ids in, sampled tokens with log-probs out.

    `generate` samples one completion continuing `prompt_ids` (the whole conversation so far: the
    episode runner passes its own copy as a typed int32 array, which the instance clients take
    as is, where a list would cost a conversion each way every turn). The returned
    `Completion.token_ids` are the new tokens only; `finish_reason` "abort" means the request
    could not finish (the episode is then masked). Errors such as `ServerError` propagate.
    """

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion: ...


class PinnedSampler:
    """A `Sampler` over an instance client, pinned to `version` (C1): every call carries the
    version, and an instance that does not hold it refuses with `VersionMismatch` rather than
    sample."""

    def __init__(
        self, client: InstanceClient, *, version: int, request_prefix: str = "episode"
    ) -> None:
        self.client = client
        self.version = version
        self.request_prefix = request_prefix

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        request_id = f"{self.request_prefix}-{uuid.uuid4().hex[:16]}"
        return await self.client.generate(
            prompt_ids, params, request_id=request_id, version=self.version
        )


@dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """Bounds on one episode."""

    max_turns: int = 8
    """Model turns (assistant messages) per episode."""
    max_total_tokens: int = 4096
    """Sampled tokens over all turns."""
    context_limit: int = 8192
    """Tokens in the whole sequence: prompt, sampled and environment tokens."""
    tool_timeout_s: float = 30.0
    """Per tool call."""
    max_tool_calls_per_turn: int = 8
    """Calls beyond this in one turn get an error message instead of running."""
    close_timeout_s: float = 30.0
    """Deadline for the environment's `close()`."""
    step_timeout_s: float = 300.0
    """Deadline for each call of `reset`, `tools` and `step`."""
    reward_timeout_s: float = 120.0
    """Deadline for `reward`."""
    episode_timeout_s: float = 0.0
    """Deadline for the whole episode, LLM calls included; 0: none (every part has its own)."""


class GroupFailed(EnvError):
    """An episode of a group failed and the group policy is `retry`: regenerate the whole group at
    the same version (if still admissible). `samples` are the G samples (the failed ones masked:
    once the retries are spent, deliver them as the group), `errors` the failures' messages."""

    def __init__(self, prompt_id: str, samples: list[Sample], errors: list[str]) -> None:
        super().__init__(f"{len(errors)} episode(s) of prompt {prompt_id!r} failed: {errors[0]}")
        self.prompt_id = prompt_id
        self.samples = samples
        self.errors = errors


@dataclass
class _Counts:
    """What an episode has done so far, for the sample (also when it fails half way)."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0


def masked_sample(task: Task, error: str) -> Sample:
    """The empty, masked sample of an episode that could not start (e.g. the env factory raised)."""
    return TokenSequence().to_sample(
        prompt_len=0,
        reward=0.0,
        finish_reason="error",
        masked=True,
        num_turns=0,
        metadata={"prompt_id": task.prompt_id, "error": error},
    )


async def run_episode(
    *,
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase | ChatRenderer,
    env: Env,
    task: Task,
    params: SamplingParams,
    limits: EpisodeLimits | None = None,
) -> Sample:
    """Run one episode of `env` on `task` with `sampler`; return its Sample (masked if the env
    failed).

    `params.max_tokens` bounds each turn; `limits` bound the episode. Pass a `ChatRenderer` instead
    of the tokenizer to skip re-probing the template for every episode.
    """
    limits = limits or EpisodeLimits()
    return await _guarded_episode(Hooks(), sampler, tokenizer, env, task, params, limits)


async def _guarded_episode(
    hooks: Hooks,
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase | ChatRenderer,
    env: Env,
    task: Task,
    params: SamplingParams,
    limits: EpisodeLimits,
) -> Sample:
    """The episode under its deadline, then `close()`; the hooks' threads go with it."""
    try:
        if not limits.episode_timeout_s:
            return await _run_episode(sampler, tokenizer, env, hooks, task, params, limits)
        deadline = asyncio.timeout(limits.episode_timeout_s)
        try:
            async with deadline:
                return await _run_episode(sampler, tokenizer, env, hooks, task, params, limits)
        except TimeoutError:
            if not deadline.expired():
                raise
            error = f"episode timed out after {limits.episode_timeout_s:g} s"
            log.warning("episode of prompt %r masked: %s", task.prompt_id, error)
            return masked_sample(task, f"{error} {_where(env, task)}")
    finally:
        await _close_env(env, hooks, task, limits.close_timeout_s)


def _where(env: Env, task: Task) -> str:
    """The tail of a masked sample's error: which environment, which task."""
    return f"(env {type(env).__name__}, task {task.prompt_id})"


async def _close_env(env: Env, hooks: Hooks, task: Task, timeout_s: float) -> None:
    """`env.close()` with a deadline; runs during cancellation too, and never raises but for it."""
    try:
        await hooks.call("close", env.close, timeout_s=timeout_s)
    except EnvFailure as failure:
        log.warning("environment close() of prompt %r failed: %s", task.prompt_id, failure)


async def _run_episode(
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase | ChatRenderer,
    env: Env,
    hooks: Hooks,
    task: Task,
    params: SamplingParams,
    limits: EpisodeLimits,
) -> Sample:
    renderer = tokenizer if isinstance(tokenizer, ChatRenderer) else ChatRenderer(tokenizer)
    if isinstance(env, AgentEnv):  # the agent's own loop, against the episode's endpoint
        return await run_agent_episode(
            sampler=sampler,
            renderer=renderer,
            env=env,
            hooks=hooks,
            task=task,
            params=params,
            limits=limits,
        )
    traj = TokenSequence()
    prompt_len = 0
    counts = _Counts()
    try:
        prompt, toolbox = await _open(renderer, env, hooks, task, limits, traj)
        prompt_len = len(traj.ids)
        if prompt_len >= limits.context_limit:
            raise EnvFailure(
                f"prompt of {prompt_len} tokens leaves no room under "
                f"context_limit {limits.context_limit}",
                "context",
            )
        episode = await _loop(
            sampler, renderer, env, hooks, task, params, limits, prompt, toolbox, traj, counts
        )
        raw = await hooks.call("reward", env.reward, episode, timeout_s=limits.reward_timeout_s)
        try:
            reward, components = reward_total(raw)
        except (TypeError, ValueError) as exc:
            raise EnvFailure(f"reward returned {exc}") from exc
    except EnvFailure as failure:
        log.warning("episode of prompt %r masked: %s", task.prompt_id, failure)
        return traj.to_sample(
            prompt_len=prompt_len,
            reward=0.0,
            finish_reason=failure.finish_reason,
            masked=True,
            num_turns=counts.turns,
            num_tool_calls=counts.tool_calls,
            metadata={"prompt_id": task.prompt_id, "error": f"{failure} {_where(env, task)}"},
        )
    return traj.to_sample(
        prompt_len=prompt_len,
        reward=reward,
        reward_components=components,
        finish_reason=episode.finish_reason,
        num_turns=episode.num_turns,
        num_tool_calls=episode.num_tool_calls,
        metadata={"prompt_id": task.prompt_id, "tool_errors": str(episode.num_tool_errors)},
    )


async def _open(
    renderer: ChatRenderer,
    env: Env,
    hooks: Hooks,
    task: Task,
    limits: EpisodeLimits,
    traj: TokenSequence,
) -> tuple[list[Message] | str, ToolBox]:
    """`reset` and `tools`: the prompt, its ids added to `traj`, and the episode's toolbox."""
    prompt = await hooks.call("reset", env.reset, task, timeout_s=limits.step_timeout_s)
    tools = await hooks.call("tools", env.tools, timeout_s=limits.step_timeout_s)
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise EnvFailure(f"tools() must return a list of tools, not {type(tools).__name__}")
    try:
        toolbox = ToolBox(tools, timeout_s=limits.tool_timeout_s)
    except TypeError as exc:
        raise EnvFailure(f"bad tool: {exc}") from exc
    if not isinstance(prompt, (str, list)):
        raise EnvFailure(f"reset() must return messages or a string, not {type(prompt).__name__}")
    if not prompt:
        raise EnvFailure(f"reset() returned an empty prompt ({prompt!r})")
    if isinstance(prompt, str):
        if len(toolbox):
            raise EnvFailure("tools need a chat prompt: reset() returned plain text")
        ids = guarded("encoding reset()'s prompt", renderer.prompt_ids, prompt, ())
    else:
        what = "rendering reset()'s messages"
        ids = guarded(what, renderer.prompt_ids, prompt, toolbox.schemas)
    if not ids:
        raise EnvFailure(f"reset() returned a prompt of no tokens ({prompt!r:.100})")
    traj.add_context(ids)
    return cast("list[Message] | str", prompt), toolbox


async def _loop(
    sampler: Sampler,
    renderer: ChatRenderer,
    env: Env,
    hooks: Hooks,
    task: Task,
    params: SamplingParams,
    limits: EpisodeLimits,
    prompt: list[Message] | str,
    toolbox: ToolBox,
    traj: TokenSequence,
    counts: _Counts,
) -> Episode:
    """The turns of one episode; fills `traj` and `counts`, returns the Episode for `reward`.

    `step` gets the messages new since the environment last spoke (`since`): the model's turns,
    their tool calls and tool results, ending with the turn that called no tool."""
    chat = not isinstance(prompt, str)
    messages: list[Message] | str = prompt if isinstance(prompt, str) else list(prompt)
    since = len(messages) if chat else 0
    sampled = 0
    completion_text = ""
    finish: FinishReason = "stop"
    while True:
        token_budget = limits.max_total_tokens - sampled
        context_budget = limits.context_limit - len(traj.ids)
        budget = min(params.max_tokens, token_budget, context_budget)
        if budget <= 0:
            finish = "context" if context_budget <= token_budget else "length"
            break
        completion = await sampler.generate(
            traj.ids[:], msgspec.structs.replace(params, max_tokens=budget)
        )
        if completion.finish_reason in ("abort", "error"):
            raise EnvFailure(f"{SAMPLER_ENDED} with {completion.finish_reason!r}", "abort")
        traj.add_sampled(completion)
        sampled += len(completion.token_ids)
        counts.turns += 1
        text = CALL_CPU.timed("turn", renderer.decode, completion.token_ids)
        if completion.finish_reason == "length":
            completion_text = renderer.split_turn_end(text)[0] if chat else text
            _record_turn(messages, _parse(completion_text, toolbox) if chat else None)
            cut_by_context = context_budget < min(params.max_tokens, token_budget)
            finish = "context" if cut_by_context else "length"
            break
        if chat:
            assert isinstance(messages, list)
            completion_text, turn_end = renderer.split_turn_end(text)
            replies, done, since = await _chat_reply(
                env, hooks, limits, toolbox, counts, messages, since, completion_text
            )
            new_ids: list[int] = []
            if not done and counts.turns < limits.max_turns:
                new_ids = CALL_CPU.timed("turn", _next_ids, renderer, turn_end, replies)
        else:
            completion_text = text
            raw = await hooks.call("step", env.step, text, timeout_s=limits.step_timeout_s)
            reply_text, done = check_reply(raw, str)
            messages = cast(str, messages) + text + reply_text
            new_ids = guarded("encoding step()'s reply", renderer.encode, reply_text)
        if done:
            finish = "stop"
            break
        if counts.turns >= limits.max_turns:
            finish = "max_turns"
            break
        if len(traj.ids) + len(new_ids) >= limits.context_limit:
            finish = "context"
            break
        traj.add_context(new_ids)
    return Episode(
        task=task,
        messages=messages,
        completion=completion_text,
        finish_reason=finish,
        num_turns=counts.turns,
        num_tool_calls=counts.tool_calls,
        num_tool_errors=counts.tool_errors,
    )


def _next_ids(renderer: ChatRenderer, turn_end: str, replies: list[Message]) -> list[int]:
    """The ids that close the model's turn and open the next: the replies, rendered."""
    return renderer.encode(turn_end) + guarded("rendering", renderer.new_message_ids, replies)


async def _chat_reply(
    env: Env,
    hooks: Hooks,
    limits: EpisodeLimits,
    toolbox: ToolBox,
    counts: _Counts,
    messages: list[Message],
    since: int,
    completion_text: str,
) -> tuple[list[Message], bool, int]:
    """Record the model's turn in `messages` and answer it: its tool calls run, or, when it called
    none, the environment's `step` gets the messages new since it last spoke. Returns the replies,
    whether the episode is done, and the new `since`."""
    parsed = _parse(completion_text, toolbox)
    _record_turn(messages, parsed)
    if parsed.calls or parsed.errors:
        replies, done = await _run_tools(toolbox, parsed, limits, counts)
        messages.extend(replies)
        return replies, done, since
    raw = await hooks.call("step", env.step, messages[since:], timeout_s=limits.step_timeout_s)
    replies, done = check_reply(raw, list)
    messages.extend(replies)
    return replies, done, len(messages)


def _parse(text: str, toolbox: ToolBox) -> ParsedTurn:
    """Tool calls only exist in episodes that offer tools; otherwise the text is just text."""
    return parse_tool_calls(text) if len(toolbox) else ParsedTurn(content=text)


def _record_turn(messages: list[Message] | str, parsed: ParsedTurn | None) -> None:
    if isinstance(messages, str) or parsed is None:
        return
    message: Message = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = parsed.calls
    messages.append(message)


async def _run_tools(
    toolbox: ToolBox, parsed: ParsedTurn, limits: EpisodeLimits, counts: _Counts
) -> tuple[list[Message], bool]:
    """Tool messages answering one turn's calls, in order, then its malformed calls' errors; and
    whether a tool ended the episode (`EndEpisode`: the calls after it do not run)."""
    replies: list[Message] = []
    for i, call in enumerate(parsed.calls):
        counts.tool_calls += 1
        if i >= limits.max_tool_calls_per_turn:
            limit = limits.max_tool_calls_per_turn
            result = ToolResult(f"Error: more than {limit} tool calls in one turn", False)
        else:
            result = await toolbox.call(call)
        counts.tool_errors += not result.ok
        name = call["function"]["name"]
        replies.append(
            {"role": "tool", "content": result.content, "tool_call_id": call["id"], "name": name}
        )
        if result.end:
            return replies, True
    for error in parsed.errors:
        counts.tool_calls += 1
        counts.tool_errors += 1
        replies.append({"role": "tool", "content": f"Error: malformed tool call: {error}"})
    return replies, False


async def run_fresh_episode(
    *,
    sampler: Sampler,
    renderer: ChatRenderer,
    env_factory: Callable[[], Env],
    task: Task,
    params: SamplingParams,
    limits: EpisodeLimits | None = None,
) -> Sample:
    """One episode of `task` on a new environment from `env_factory` (user code too: it runs in
    a worker thread, under `step_timeout_s`); a factory that raises gives a masked sample
    (`env factory raised ...`), as an episode that fails does."""
    limits = limits or EpisodeLimits()
    hooks = Hooks()
    try:
        made = await hooks.call("env factory", env_factory, timeout_s=limits.step_timeout_s)
    except EnvFailure as failure:
        return masked_sample(task, f"{failure} (task {task.prompt_id})")
    env = cast(Env, made)
    return await _guarded_episode(hooks, sampler, renderer, env, task, params, limits)


async def run_group(
    *,
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase | ChatRenderer,
    env_factory: Callable[[], Env],
    task: Task,
    group_size: int,
    params: SamplingParams,
    limits: EpisodeLimits | None = None,
    on_error: ErrorPolicy = "mask",
) -> list[Sample]:
    """Run the `group_size` episodes of one group concurrently (one env object each).

    With `on_error="mask"` failed episodes come back as masked samples (the group stays whole, C2).
    With `on_error="retry"` a failure raises `GroupFailed` once every episode has finished; the
    caller regenerates the group at the same version, at most R times, then masks.
    """
    renderer = tokenizer if isinstance(tokenizer, ChatRenderer) else ChatRenderer(tokenizer)

    async with asyncio.TaskGroup() as tg:
        running = [
            tg.create_task(
                run_fresh_episode(
                    sampler=sampler,
                    renderer=renderer,
                    env_factory=env_factory,
                    task=task,
                    params=params,
                    limits=limits,
                )
            )
            for _ in range(group_size)
        ]
    samples = [t.result() for t in running]
    errors = [s.metadata.get("error", "") for s in samples if s.masked]
    if errors and on_error == "retry":
        raise GroupFailed(task.prompt_id, samples, errors)
    return samples
