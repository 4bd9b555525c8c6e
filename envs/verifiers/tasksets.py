"""verifiers tasksets (`verifiers.v1`, as verifiers 0.3 ships it beside its classic API), rolled out
by dora's own chat loop against the episode's endpoint: see the package docstring for the config.

`taskset` names an installed verifiers taskset, as `vf eval` takes it (`--env.taskset.id`): a
module exporting its `vf.Taskset` subclass in `__all__`; `config` holds that taskset config's
fields. An episode runs the task's system prompt and prompt, the tools of its `Task.toolsets`
(each `@vf.tool` method, named `<server>_<tool>` as verifiers advertises them), tool results
appended until the model answers without a call or `max_turns` model turns are done. The task's
`@vf.reward` functions then score a `vf.Trace` of the conversation; each becomes a reward
component worth `score * weight`, so the reward is verifiers' `trace.reward`.
"""

from __future__ import annotations

import functools
import inspect
import json
import numbers
from collections.abc import Callable, Mapping
from typing import Any, cast

from dora import ConfigError, Task, ToolBox, ToolCall
from envs.verifiers.classic import import_verifiers

__all__ = ["Tasksets", "load_taskset"]


def _vf() -> Any:
    return import_verifiers("verifiers.v1")


def load_taskset(key: str, taskset: str, config: Mapping[str, object]) -> Any:
    """The verifiers taskset `taskset`; a ConfigError naming `key` if it cannot be loaded."""
    vf = _vf()
    from verifiers.v1.utils.loaders import taskset_config_type

    try:
        config_type = taskset_config_type(taskset)
        return vf.load_taskset(config_type(id=taskset, **config))
    except Exception as exc:
        raise ConfigError(
            f"env.kwargs.{key} = {taskset!r}: cannot load this verifiers taskset "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _tools(vtask: Any, config: Any) -> list[Callable[..., Any]]:
    """The task's toolset methods, named as verifiers advertises them (`<server>_<tool>`)."""
    from verifiers.v1.state import State
    from verifiers.v1.utils.decorators import discover_decorated

    tools = []
    for toolset in type(vtask).toolsets(config):
        if toolset._state_cls is not State:
            raise TypeError(f"toolset {type(toolset).__name__} keeps state: not supported")
        for fn in discover_decorated(toolset, "tool"):
            name = getattr(fn, "tool_name", None) or fn.__name__
            prefix = toolset.server_name

            @functools.wraps(fn)
            async def tool(*args: Any, _fn: Any = fn, **kwargs: Any) -> str:
                result = _fn(*args, **kwargs)
                result = await result if inspect.isawaitable(result) else result
                return result if isinstance(result, str) else json.dumps(result)

            tool.__name__ = f"{prefix}_{name}" if prefix else name
            tool.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
            tools.append(cast(Callable[..., Any], tool))
    return tools


def _prompt(vf: Any, data: Any, system_prompt: str | None) -> list[dict[str, Any]]:
    system = data.system_prompt or system_prompt
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages.extend(m.model_dump(exclude_none=True) for m in data.prompt or [])
    return messages


async def _chat(
    base_url: str, model: str, messages: list[dict[str, Any]], box: ToolBox, max_turns: int
) -> None:
    """The chat loop: the model, its tool calls answered, until it answers without one."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="dora", max_retries=0) as client:
        for _ in range(max_turns):
            # plain dicts in OpenAI's wire shape: the client's TypedDicts are for literals
            response = await client.chat.completions.create(
                model=model, messages=cast(Any, messages), tools=cast(Any, box.schemas or None)
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return
            for call in message.tool_calls:
                native: ToolCall = call.model_dump()  # type: ignore[assignment]
                result = await box.call(native)
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": result.content}
                )


def _trace(vf: Any, vtask: Any, messages: list[dict[str, Any]]) -> Any:
    """A `vf.Trace` of the conversation, for the task's reward functions."""
    from pydantic import TypeAdapter
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    adapter = TypeAdapter(vf.Message)
    nodes = []
    for i, raw in enumerate(messages):
        message = dict(raw)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c["id"], **{k: c["function"][k] for k in ("name", "arguments")}}
                for c in message["tool_calls"]
            ]
        nodes.append(
            MessageNode(
                parent=i - 1 if i else None,
                message=adapter.validate_python(message),
                sampled=message["role"] == "assistant",
            )
        )
    task = TraceTask(type=type(vtask).__name__, data=vtask.data, key=vtask.key, hash=vtask.hash)
    return vf.Trace(task=task, agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


async def _score(vtask: Any, trace: Any) -> dict[str, float]:
    """Each `@vf.reward` function's score times its weight; keyed scores of a function are
    components of their own. A value that is not a number is refused, never parsed."""
    from verifiers.v1.utils.decorators import invoke_all

    if vtask.plugged_judges():
        raise TypeError("verifiers judges are not supported")
    rewards = vtask.hooks("reward")
    if not rewards:
        raise TypeError(f"task {type(vtask).__name__} has no @vf.reward function")
    results = await invoke_all(rewards, {"task": vtask.data, "trace": trace})
    components: dict[str, float] = {}
    for fn, result in zip(rewards, results, strict=True):
        weight = float(getattr(fn, "_vf_weight", 1.0))
        items = result.items() if isinstance(result, Mapping) else [(fn.__name__, result)]
        for name, value in items:
            if not _is_number(value):
                raise TypeError(f"reward {name!r} returned {value!r:.80}, not a number")
            components[str(name)] = float(value) * weight
    return components


class Tasksets:
    """The loaded tasksets of a run: their tasks, and one episode of a task."""

    def __init__(self, taskset: Any, eval_taskset: Any, max_turns: int) -> None:
        self.taskset, self.eval_taskset, self.max_turns = taskset, eval_taskset, max_turns

    @classmethod
    def load(cls, kwargs: Mapping[str, object]) -> Tasksets:
        """`taskset` (and `eval_taskset`) loaded: a start-up error names the key that failed."""
        taskset, eval_taskset = kwargs.get("taskset"), kwargs.get("eval_taskset") or ""
        if not isinstance(taskset, str) or not taskset:
            raise ConfigError("env.kwargs.taskset must name an installed verifiers taskset")
        config, eval_config = kwargs.get("config") or {}, kwargs.get("eval_config") or {}
        assert isinstance(config, Mapping) and isinstance(eval_config, Mapping)
        loaded = load_taskset("taskset", taskset, config)
        loaded_eval = None
        if eval_taskset:
            loaded_eval = load_taskset("eval_taskset", str(eval_taskset), eval_config)
        max_turns = kwargs.get("max_turns", 8)
        assert isinstance(max_turns, int)
        return cls(loaded, loaded_eval, max_turns)

    def tasks(self, split: str) -> list[Task] | None:
        """`train`: the taskset's tasks; `test`: `eval_taskset`'s (None without one)."""
        source = self.taskset if split == "train" else self.eval_taskset
        if source is None:
            return None
        return [
            Task(f"{split}-{vtask.data.name or i}", vtask.data.model_dump(mode="json"))
            for i, vtask in enumerate(source)
        ]

    async def agent(self, base_url: str, model: str, task: Task) -> dict[str, float]:
        vf = _vf()
        source = self.taskset if task.prompt_id.startswith("train-") else self.eval_taskset
        task_type = type(source).task_type()
        vtask = task_type(task_type.data_type().model_validate(dict(task.data)), source.config.task)
        box = ToolBox(_tools(vtask, source.config.task))
        messages = _prompt(vf, vtask.data, source.system_prompt)
        await _chat(base_url, model, messages, box, self.max_turns)
        return await _score(vtask, _trace(vf, vtask, messages))
