"""verifiers environments of the classic API (`vf.load_environment`, `SingleTurnEnv`,
`MultiTurnEnv`, `ToolEnv` and their subclasses), each episode verifiers' own rollout against the
episode's endpoint: see the package docstring for the config.

`environment` names an installed environment the way `vf-eval` and the Environments Hub do (a
module, or a hub id such as `owner/my-env`, whose `load_environment(**kwargs)` builds it, with
the config's other `env.kwargs`). Its
dataset's rows are the training tasks, its eval dataset's the held-out ones (none without one).
An episode is `env.rollout(row, client, model, env.sampling_args)` with verifiers' chat
completions client over an `openai.AsyncOpenAI` pointed at the episode's base URL; the
environment's own loop decides the turns, its tools run as it runs them. Its rubric then scores
the finished state: every reward function of weight other than 0 (in a `RubricGroup` too) is
called as verifiers calls it and becomes a component worth `score * weight`, so the reward is
verifiers' `state["reward"]`. Weight-0 functions are verifiers' metrics and are not run.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import numbers
import re
import signal
from collections.abc import Iterator, Mapping
from typing import Any

from dora import ConfigError, Task

__all__ = ["Classic", "import_verifiers"]

NEEDS_SANDBOX = ("SandboxEnv", "SandboxMixin", "CliAgentEnv")
"""Environment classes whose rollouts run in a remote sandbox or container: not supported."""


SUPPORTED = ((0, 3, 1), (0, 4))
"""The verifiers versions this adapter runs on: >= 0.3.1, < 0.4 (the extra's pin)."""


def supported(version: str) -> bool:
    """Whether verifiers `version` (`0.3.1`, `0.3.2.dev1`) is one this adapter runs on."""
    release = tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])
    return SUPPORTED[0] <= release < SUPPORTED[1]


def import_verifiers(name: str = "verifiers") -> Any:
    """The verifiers module `name` (`verifiers.v1` for tasksets); a ConfigError without it, or
    with a version this adapter does not run on."""
    need = "envs.verifiers needs verifiers>=0.3.1,<0.4: pip install -e '.[verifiers]'"
    try:
        found = importlib.metadata.version("verifiers")
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"{need} ({exc})") from exc
    if not supported(found):
        raise ConfigError(f"{need} (found verifiers {found})")
    return module


def reward_functions(rubric: Any) -> Iterator[tuple[Any, Any, float]]:
    """(rubric, function, weight) of every function of `rubric`, a `RubricGroup`'s flattened."""
    if hasattr(rubric, "rubrics"):
        for inner in rubric.rubrics:
            yield from reward_functions(inner)
        return
    for fn, weight in zip(rubric.funcs, rubric.weights, strict=True):
        yield rubric, fn, float(weight)


def _refusal(env: Any) -> str | None:
    """Why `env` cannot be trained here, or None."""
    names = {cls.__name__ for cls in type(env).__mro__}
    for name in NEEDS_SANDBOX:
        if name in names:
            return f"{type(env).__name__} is a {name}: its rollouts need a remote sandbox"
    rewards = [(r, fn) for r, fn, w in reward_functions(env.rubric) if w != 0]
    if not rewards:
        return f"{type(env).__name__}'s rubric has no reward function of weight other than 0"
    for rubric, fn in rewards:
        if rubric._is_group_func(fn):
            return f"reward function {fn.__name__!r} scores a whole group"
    if env.requires_group_rollouts or env.provides_advantages:
        return f"{type(env).__name__} rolls out and scores whole groups"
    return None


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """verifiers' `Environment.__init__` installs SIGINT and SIGTERM handlers of its own (which
    exit the process after its teardown); within this block it cannot: the process keeps dora's
    (and loading works outside the main thread, where `signal.signal` raises)."""
    install = signal.signal

    def keep(signum: int, handler: Any) -> Any:
        return signal.getsignal(signum)

    signal.signal = keep  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = install


def load_classic(key: str, environment: str, env_args: Mapping[str, object]) -> Any:
    """`vf.load_environment(environment, **env_args)`; a ConfigError naming `key` if it fails or
    the environment is one dora cannot train on."""
    vf = import_verifiers()
    try:
        with _signal_handlers_kept():
            env = vf.load_environment(environment, **env_args)
    except Exception as exc:
        cause = exc.__cause__ or exc
        raise ConfigError(
            f"env.kwargs.{key} = {environment!r}: cannot load this verifiers environment "
            f"({type(cause).__name__}: {cause})"
        ) from exc
    if not isinstance(env, vf.Environment):
        raise ConfigError(
            f"env.kwargs.{key} = {environment!r}: load_environment returned {env!r:.80}, "
            "not a verifiers Environment"
        )
    refusal = _refusal(env)
    if refusal:
        raise ConfigError(f"env.kwargs.{key} = {environment!r}: not supported: {refusal}")
    return env


def _rows(dataset: Any, split: str) -> list[Task] | None:
    if dataset is None:
        return None
    return [Task(f"{split}-{row['example_id']}", row) for row in dataset.to_list()]


def _is_number(value: object) -> bool:
    """A real number, as verifiers' `float(...)` takes one without parsing (a bool counts)."""
    return isinstance(value, numbers.Real)


async def _call(rubric: Any, fn: Any, state: Any) -> object:
    """`fn` called with what verifiers passes it: the state's score objects its signature names
    (all of them if it takes `**kwargs`)."""
    objects = rubric.score_objects(state)
    parameters = inspect.signature(fn).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        names = {p.name for p in parameters}
        objects = {k: v for k, v in objects.items() if k in names}
    result = fn(**objects)
    return await result if inspect.isawaitable(result) else result


async def score(rubric: Any, state: Any) -> dict[str, float]:
    """Each reward function's score times its weight, by the function's name (a repeated name
    gets `#2`, `#3`, ...). A value that is not a number is refused, never parsed."""
    components: dict[str, float] = {}
    for inner, fn, weight in reward_functions(rubric):
        if weight == 0:
            continue
        name = str(getattr(fn, "__name__", "reward"))
        value = await _call(inner, fn, state)
        if not _is_number(value):
            raise TypeError(f"reward {name!r} returned {value!r:.80}, not a number")
        n = 1
        while (f"{name}#{n}" if n > 1 else name) in components:
            n += 1
        components[f"{name}#{n}" if n > 1 else name] = float(value) * weight  # type: ignore[arg-type]
    return components


class Classic:
    """A loaded classic environment: its tasks, and one episode of a task."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.train = _rows(env.build_dataset(), "train")
        self.test = _rows(env.build_eval_dataset(), "test")

    @classmethod
    def load(cls, kwargs: Mapping[str, object]) -> Classic:
        environment = kwargs.get("environment")
        env_args = {k: v for k, v in kwargs.items() if k != "environment"}
        if not isinstance(environment, str) or not environment:
            raise ConfigError("env.kwargs.environment must name an installed verifiers environment")
        env = load_classic("environment", environment, env_args)
        try:
            return cls(env)
        except Exception as exc:
            raise ConfigError(
                f"env.kwargs.environment = {environment!r}: cannot build its datasets "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    def tasks(self, split: str) -> list[Task] | None:
        """`train`: the dataset's rows; `test`: the eval dataset's (None without one)."""
        return self.train if split == "train" else self.test

    async def agent(self, base_url: str, model: str, task: Task) -> dict[str, float]:
        from openai import AsyncOpenAI
        from verifiers.clients import OpenAIChatCompletionsClient

        async with AsyncOpenAI(base_url=base_url, api_key="dora", max_retries=0) as openai:
            client = OpenAIChatCompletionsClient(openai)
            state = await self.env.rollout(
                dict(task.data), client, model, dict(self.env.sampling_args)
            )
        error = state.get("error")
        if error is not None:
            causes: list[str] = []
            while error is not None and len(causes) < 2:
                causes.append(f"{type(error).__name__}: {error}".strip(": "))
                error = error.__cause__ or error.__context__
            raise RuntimeError(f"the verifiers rollout failed: {' <- '.join(causes)}")
        return await score(self.env.rubric, state)
