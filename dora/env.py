"""The environment API: what a user writes to train a model on a task.

An environment is a class. One object is made **per episode** by a factory (the class itself, or
`load_env("module:Class", **kwargs)`), so per-episode state lives on `self`: a game board, a
shopping cart, the number of guesses so far. The reason: the G episodes of a group, and hundreds of
episodes in one event loop, run concurrently; an object per episode means tools and `step` can keep
state without locks, without leaking between episodes and without stringly typed state dicts. What
is shared and expensive (a dataset, a database snapshot, a process pool for scoring) is made once
per process by the class's `setup(**kwargs)` and passed to every episode's constructor: `load_env`
calls it once and binds what it returns, next to the config's kwargs, into the factory.

An environment may bring its own tasks: `tasks(split)` lists them (tau2's domains ship theirs), so
`env.cls` alone names a runnable task (`data.source = "env"`, the default, reads them).

The life of an episode (the runner is `dora.episode.run_episode`):

1. `reset(task)` returns the opening messages (OpenAI chat format, rendered with the tokenizer's
   chat template) or a plain string, which needs no chat template (base models, completion-style
   tasks): it becomes the ids `tokenizer(prompt)` gives, special tokens such as a base model's
   `<bos>` included (`env.prompt_special_tokens = false` leaves them out).
2. The model samples a turn. If it called tools (`tools()` lists plain typed functions, sync or
   async, whose signature and docstring become the OpenAI schema), the runner runs them and appends
   the tool results; the model goes again. A tool that returns `EndEpisode(result)` ends the
   episode there (a winning move, a submitted answer).
3. A turn without tool calls goes to `step(messages)`, which returns the environment's reply and
   whether the episode is over. `messages` are the ones new since the environment last spoke (its
   prompt or its last reply): the model's turns since then, with their tool calls and results,
   ending with the turn that called no tool; in plain text, the model's turn. An environment that
   wants the whole conversation keeps it (`Episode.messages` has it for the reward). The default
   ends the episode (for chat and for plain text): a single-turn task or a ReAct-style tool loop
   needs no `step`. A simulated user or a game overrides it.
4. `reward(episode)` scores the finished episode: a float, or a dict of named components whose sum
   is the reward: real numbers only, finite; text such as "0.5" is refused, never parsed. Any of
   `reset`, `step`, `reward` may be `async`; a synchronous one runs in a worker thread of its
   episode, never on serve's event loop, and each has a deadline (`env.step_timeout_s`,
   `env.reward_timeout_s`). CPU-heavy scoring belongs in a `ScorerPool`.
5. `close()` (async) releases what the episode holds (client sessions, sandboxes, processes). The
   runner awaits it once at the end of every episode it runs, however the episode ends: normally,
   by an error (one in `reset` too), or cancelled (then it still runs, bounded by a deadline, and
   the cancellation propagates after it).

An agent that runs its own loop against an OpenAI-compatible endpoint is an `AgentEnv` (or a plain
function, made one by `agent_env`): its episodes call `agent(base_url, model, task)`, which returns
the reward, instead of the steps above (`dora.endpoint` serves and records its calls).

`demonstration(task)` is used only by the supervised warm-up (`dora.models.warmup`): the reference
continuation of `reset(task)`'s conversation (assistant turns with their tool calls, tool results,
replies), which teaches a model from scratch the format before RL.

An exception from `reset`, `step` or `reward`, a hook past its deadline or a value it returns
that cannot be used never crashes training: the episode's sample is masked
(it stays in its group but has no gradient), the error is logged and counted, and the group policy
applies. An exception inside a tool is the model's business: it becomes a tool message.

Tasks are `Task(prompt_id, data)`; a `PromptStream` cycles through a list of them forever,
reshuffled each epoch with a seed, and can resume from a position.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import multiprocessing
import multiprocessing.pool
import os
import random
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, ParamSpec, Required, TypedDict, TypeVar, cast

from dora.errors import ConfigError
from dora.protocol import FinishReason
from dora.tools import EndEpisode, ToolCall, ToolFunction

__all__ = [
    "AgentEnv",
    "EndEpisode",
    "Env",
    "Episode",
    "Message",
    "Prompt",
    "PromptStream",
    "Reply",
    "Reward",
    "ScorerPool",
    "SingleTurnEnv",
    "Task",
    "agent_env",
    "load_env",
    "load_object",
]

P = ParamSpec("P")
T = TypeVar("T")


class Message(TypedDict, total=False):
    """One chat message in OpenAI format."""

    role: Required[str]
    content: Required[str]
    tool_calls: NotRequired[list[ToolCall]]
    tool_call_id: NotRequired[str]
    name: NotRequired[str]


Prompt = list[Message] | str
"""What `reset` returns: chat messages (rendered with the chat template), or plain text (tokenized
as `tokenizer(prompt)`, no chat template)."""

Reply = tuple[list[Message] | str, bool]
"""What `step` returns: the environment's reply (messages, or text in plain-text episodes) and
`done`."""

Reward = float | dict[str, float]
"""A reward, or named components whose sum is the reward: real numbers (numpy's too), never text."""


@dataclass(frozen=True)
class Task:
    """One prompt of a dataset. `prompt_id` is stable across runs (it names the group in logs and in
    the journal); `data` is the row: whatever `reset` and `reward` need (question, answer, ...)."""

    prompt_id: str
    data: Mapping[str, object] = field(default_factory=dict)

    def __getitem__(self, key: str) -> object:
        return self.data[key]


@dataclass
class Episode:
    """A finished episode, as `reward` sees it.

    `messages` is the whole conversation in OpenAI format (assistant turns carry their parsed
    `tool_calls`), or for plain-text episodes the prompt followed by the turns. `completion` is the
    text of the model's last turn. `finish_reason` says why the episode ended: "stop" (done),
    "length" (token budget), "context" (context limit), "max_turns" (`rollout.max_turns` reached).
    """

    task: Task
    messages: list[Message] | str
    completion: str
    finish_reason: FinishReason
    num_turns: int
    num_tool_calls: int
    num_tool_errors: int


class Env:
    """Base class of environments; one object per episode (see the module docstring).

    Override `reset` and `reward`; add `tools` and `step` for multi-turn tasks. Each may be async.
    """

    def reset(self, task: Task) -> Prompt | Awaitable[Prompt]:
        """The opening messages of an episode for `task` (or a plain-text prompt)."""
        raise NotImplementedError(f"{type(self).__name__} must implement reset(task)")

    def tools(self) -> Sequence[ToolFunction]:
        """The functions the model may call this episode (bound methods can use `self`)."""
        return []

    def step(self, messages: list[Message] | str) -> Reply | Awaitable[Reply]:
        """Answer a model turn that called no tool; the default ends the episode.

        `messages` are the messages new since the environment last spoke (reset's prompt or its
        last reply): the model's turns, their tool calls and tool results, ending with the turn
        that called no tool; a plain-text episode gets the model's turn as text. Reply messages
        returned with `done=True` are recorded in `Episode.messages` (for the reward) but not
        tokenized: the model never answers them. A plain-text episode gets an empty text.
        """
        return ("" if isinstance(messages, str) else []), True

    def reward(self, episode: Episode) -> Reward | Awaitable[Reward]:
        """Score the finished episode."""
        raise NotImplementedError(f"{type(self).__name__} must implement reward(episode)")

    async def close(self) -> None:
        """Release what this episode holds; awaited once after every episode, however it ended."""

    @classmethod
    def setup(cls, **kwargs: object) -> Mapping[str, object]:
        """Resources shared by every episode of this process, made once: the keyword arguments
        that `load_env` adds to `kwargs` (the config's) for every episode's constructor.

        Called with the config's kwargs by `load_env`, once per factory (dora's commands build one
        per process). What it makes lives as long as the process (a scorer's process pool, a
        dataset, a database snapshot); make it lazy if it is costly and not always used. The
        default shares nothing.
        """
        return {}

    def tasks(self, split: str, **kwargs: Any) -> Sequence[Task] | None:
        """The environment's own tasks of `split`, or None when it has none (the default).

        `data.source = "env"` reads them: `split` is `data.split` ("train" by default) for
        training and `data.eval_split` ("test") for evaluation, `kwargs` are `data.kwargs` (or
        `data.eval_kwargs`), plus `seed=data.seed` when the method takes a `seed`. Called on an
        object built with the config's kwargs (it can read its settings), which runs no episode.
        """
        return None

    def demonstration(self, task: Task) -> list[Message] | Awaitable[list[Message] | None] | None:
        """A reference continuation of `reset(task)`'s messages, for the supervised warm-up.

        Called after `reset(task)` on the same object. Returns the messages a good episode would
        add, in order: assistant turns (with `tool_calls`), the tool results that answer them
        (`tool_call_id` set to the call's id), the environment's replies, ending with the
        assistant's last turn. The warm-up trains on the assistant turns only. None (the default)
        means no demonstration: the warm-up then uses the task's `answer` field, if any, as the
        reply to the prompt.
        """
        return None


class SingleTurnEnv(Env):
    """Prompt -> answer -> reward. Subclasses write `prompt(task)` and `score(answer, task)`.

    `system_prompt`, when set, opens the conversation. `chat` is True by default (the prompt is a
    user message, rendered with the chat template); `chat = False` sends it as plain text, which
    base models without a chat template need.
    """

    system_prompt: str | None = None
    chat: bool = True

    def prompt(self, task: Task) -> str:
        """The user message; by default the task's `question` (or `prompt`) field."""
        for key in ("question", "prompt", "problem"):
            if key in task.data:
                return str(task.data[key])
        raise KeyError(
            f"task {task.prompt_id!r} has no question/prompt/problem field; override prompt()"
        )

    def score(self, answer: str, task: Task) -> Reward | Awaitable[Reward]:
        """The reward of `answer` (the model's reply) to `task`."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(answer, task)")

    def reset(self, task: Task) -> Prompt:
        if not self.chat:
            return self.prompt(task)
        messages: list[Message] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": self.prompt(task)})
        return messages

    def reward(self, episode: Episode) -> Reward | Awaitable[Reward]:
        return self.score(episode.completion, episode.task)


class AgentEnv(Env):
    """An environment whose episodes are an agent function's own loop (`dora.endpoint`).

    Subclasses write `agent`; `tasks` as on `Env`. `reset`, `step` and `reward` are not used.
    """

    async def agent(self, base_url: str, model: str, task: Task) -> Reward:
        """Run one episode against `base_url` asking for `model`; return its reward."""
        raise NotImplementedError(f"{type(self).__name__} must implement agent(...)")

    def reset(self, task: Task) -> Prompt:
        raise TypeError(f"{type(self).__name__} is an agent: its episodes run agent(...)")

    def reward(self, episode: Episode) -> Reward:
        raise TypeError(f"{type(self).__name__} is an agent: agent(...) returns the reward")


AgentFn = Callable[..., Reward | Awaitable[Reward]]


def agent_env(
    fn: AgentFn, *, tasks: Callable[..., Sequence[Task] | None] | None = None
) -> type[AgentEnv]:
    """An `AgentEnv` class running `fn(base_url, model, task, **kwargs)` (the config's
    `env.kwargs`), awaited on the loop if it is `async`, else in a worker thread;
    `tasks(split, **kwargs)`, when given, lists its tasks (`data.source = "env"`)."""
    if not callable(fn):
        raise TypeError(f"agent_env needs a function, not {fn!r}")
    sync = not inspect.iscoroutinefunction(fn)

    class Wrapped(AgentEnv):
        def __init__(self, **kwargs: object) -> None:
            inspect.signature(fn).bind("url", "model", Task("check"), **kwargs)
            self.kwargs = kwargs

        def agent(self, base_url: str, model: str, task: Task) -> Reward:  # type: ignore[override]
            return cast(Reward, fn(base_url, model, task, **self.kwargs))

        def tasks(self, split: str, **kwargs: object) -> Sequence[Task] | None:
            return None if tasks is None else tasks(split, **kwargs)

    if not sync:  # awaited on the loop, not in a thread

        async def run(self: Wrapped, base_url: str, model: str, task: Task) -> Reward:
            return await cast("Awaitable[Reward]", fn(base_url, model, task, **self.kwargs))

        Wrapped.agent = run  # type: ignore[assignment, method-assign]
    Wrapped.__name__ = Wrapped.__qualname__ = getattr(fn, "__name__", "agent")
    Wrapped.__module__ = getattr(fn, "__module__", __name__)
    Wrapped.__doc__ = fn.__doc__
    return Wrapped


async def call_maybe_async(
    fn: Callable[P, T | Awaitable[T]], *args: P.args, **kwargs: P.kwargs
) -> T:
    """Call `fn`; await the result if it is awaitable (an `async def` hook)."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        return cast(T, await result)
    return result


# --- loading --------------------------------------------------------------------------------------


def load_object(spec: str) -> object:
    """Import `"package.module:attribute"`; a ConfigError says what failed and how to fix it."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"{spec!r} is not of the form 'package.module:Name', "
            "e.g. 'envs.math:ChainArithmeticEnv'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise ConfigError(f"cannot import module {module_name!r} for {spec!r}: {exc}") from exc
        raise ConfigError(
            f"cannot import module {module_name!r} for {spec!r}: {exc}. Modules are imported "
            f"from the working directory ({os.getcwd()}), then PYTHONPATH and the installed "
            "packages: run dora from the folder that holds it, or add that folder to PYTHONPATH"
        ) from exc
    except ImportError as exc:
        raise ConfigError(f"cannot import module {module_name!r} for {spec!r}: {exc}") from exc
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = ", ".join(n for n in dir(module) if not n.startswith("_"))
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}; it has: {names}")
        obj = getattr(obj, part)
    return obj


def load_env(spec: str, **kwargs: object) -> Callable[[], Env]:
    """The env factory named by `"module:Class"`, bound to `kwargs` and to what the class's
    `setup(**kwargs)` shares: call it once per episode. A function (`"module:solve"`) is an
    agent's own loop, made an environment by `dora.endpoint.agent_env`.

    The class is instantiated once here to check the kwargs, so a bad config fails at load time with
    a ConfigError, not in the middle of a run.
    """
    cls = load_object(spec)
    if inspect.isfunction(cls):  # an agent's own loop (dora.endpoint)
        try:
            inspect.signature(cls).bind("base_url", "model", Task("check"), **kwargs)
        except TypeError as exc:
            raise ConfigError(
                f"{spec!r} is a function, not a subclass of dora.Env; a function is taken as an "
                f"agent's own loop, fn(base_url, model, task, **env.kwargs), but: {exc}"
            ) from exc
        cls = agent_env(cls)
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise ConfigError(f"{spec!r} is {cls!r}, not a subclass of dora.Env")
    try:
        shared = dict(cls.setup(**kwargs))
    except TypeError as exc:
        raise ConfigError(f"{spec}.setup() rejected {sorted(kwargs)}: {exc}") from exc
    clash = sorted(set(shared) & set(kwargs))
    if clash:
        raise ConfigError(f"{spec}.setup() returned {clash}, which the kwargs set already")
    try:
        cls(**kwargs, **shared)
    except TypeError as exc:
        raise ConfigError(f"cannot build {spec!r} with {sorted(kwargs)}: {exc}") from exc
    return functools.partial(cls, **kwargs, **shared)


# --- tasks ----------------------------------------------------------------------------------------


class PromptStream:
    """An endless stream of tasks: every epoch visits each task once, in an order shuffled by
    `(seed, epoch)`, so the stream is reproducible and `PromptStream(tasks, seed=s, position=p)`
    resumes exactly where a stream that had handed out `p` tasks stopped (the dispatcher journals
    `position`).
    """

    def __init__(
        self, tasks: Sequence[Task], *, seed: int = 0, shuffle: bool = True, position: int = 0
    ):
        if not tasks:
            raise ConfigError("the task list is empty: a prompt stream needs at least one task")
        ids = [t.prompt_id for t in tasks]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ConfigError(
                f"prompt_id {dup!r} appears more than once; prompt ids must be unique"
            )
        self.tasks = list(tasks)
        self.seed = seed
        self.shuffle = shuffle
        self.position = position
        self._order: list[int] = []
        self._order_epoch = -1

    @property
    def epoch(self) -> int:
        return self.position // len(self.tasks)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> Task:
        """The next task; advances `position`."""
        epoch, index = divmod(self.position, len(self.tasks))
        if epoch != self._order_epoch:
            self._order, self._order_epoch = self._epoch_order(epoch), epoch
        self.position += 1
        return self.tasks[self._order[index]]

    def __iter__(self) -> Iterator[Task]:
        while True:
            yield self.next()


# --- scoring off the event loop -------------------------------------------------------------------


class ScorerPool:
    """Runs CPU-heavy scoring functions in worker processes, each call with a timeout.

    A process pool, not threads: scorers such as math-verify use `signal.alarm`, which works only in
    a main thread, and CPU-bound Python in a thread would still hold the GIL against the event loop.
    A call that times out poisons its worker, so the pool is terminated and rebuilt (other calls in
    flight on the old pool fail with TimeoutError too, and callers treat that as a zero score or an
    env error). Functions and arguments must be picklable (module-level functions). Use as `async
    with ScorerPool() as pool`.
    """

    def __init__(self, *, processes: int = 1, timeout_s: float = 10.0) -> None:
        self.processes = processes
        self.timeout_s = timeout_s
        self._pool: multiprocessing.pool.Pool | None = None

    def _get_pool(self) -> multiprocessing.pool.Pool:
        if self._pool is None:
            # spawn: forking a process that runs threads (torch, executors) can deadlock.
            self._pool = multiprocessing.get_context("spawn").Pool(self.processes)
        return self._pool

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in a worker process; raises TimeoutError after `timeout_s`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(value: T | None, exc: BaseException | None) -> None:
            if future.done():
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(cast(T, value))

        def done(value: T) -> None:
            loop.call_soon_threadsafe(settle, value, None)

        def failed(exc: BaseException) -> None:
            loop.call_soon_threadsafe(settle, None, exc)

        pool = self._get_pool()
        pool.apply_async(fn, args, callback=done, error_callback=failed)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await future
        except TimeoutError:
            if self._pool is pool:
                self._pool = None
                await asyncio.to_thread(pool.terminate)
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    async def __aenter__(self) -> ScorerPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)
