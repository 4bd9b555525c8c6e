"""Tools: plain typed Python functions, their OpenAI schemas, tool calls parsed from sampled text,
and running those calls with timeouts.

A tool is any function (sync or async) with annotated parameters. Its name is the function's name,
its description the docstring's text before the `Args:` section, and each parameter's description
comes from the Google-style `Args:` section (`name: text` or `name (type): text`) or from
`Annotated[T, "text"]`. Parameters without a default are required. A tool whose schema exists
already (another framework's tools, an MCP server, pydantic-typed methods) is a `Tool(schema, fn)`
instead: the schema is sent as it is and `fn` gets the model's arguments as keyword arguments,
checked only for being a JSON object with the required names and no unknown ones (types are `fn`'s
to check: a synthetic signature would lose what the schema says). Either kind may declare a
parameter annotated `CallId`: it is left out of the schema and receives the id of the call being
run (the id the tool message answers), so a tool can record its calls under the conversation's own
ids.

Tool calls are parsed from the sampled text by `dora.tool_calls.parse_tool_calls` (re-exported
here), the parser the engine's chat endpoint uses too.

A tool ends the episode by returning `EndEpisode(result)`: `result` becomes the tool message as any
result would, the episode ends after that call ("stop"), and the calls written after it in the same
turn are not run. A game's winning move, a submitted answer, a closed ticket end the episode where
they happen, without a `step` to notice them.

Everything that goes wrong on the model's side becomes a tool message the model reads, never an
exception: malformed JSON, an unknown tool, bad arguments, a tool that raises, a tool that hangs (it
is timed out). Sync tools run in the ToolBox's own worker threads (`dora.hooks.OffLoop`, as every
synchronous hook of an environment does), so they cannot block the event loop, and a hung one
cannot starve the loop's default executor; a timed-out sync tool keeps its thread until it returns
(Python cannot kill a thread), so tools that can hang for good should be async or bound their own
work. `close()` lets the threads go.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, NewType

import msgspec

from dora.hooks import HookTimeout, OffLoop, call_hook
from dora.tool_calls import FunctionCall, ParsedTurn, ToolCall, parse_tool_calls

__all__ = [
    "JSON",
    "CallId",
    "EndEpisode",
    "FunctionCall",
    "ParsedTurn",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolFunction",
    "ToolResult",
    "parse_tool_calls",
    "tool_schema",
]

JSON = dict[str, object]

CallId = NewType("CallId", str)
"""Annotate a tool parameter with this to receive the id of the call being run (not in the
schema)."""


@dataclass(frozen=True)
class Tool:
    """A tool given by its ready-made OpenAI schema and the callable that runs it.

    `schema` is `{"type": "function", "function": {"name", "description", "parameters"}}` (or just
    the inner function object). `fn` (sync or async) is called with the model's arguments as
    keyword arguments, plus the call id for a parameter annotated `CallId`.
    """

    schema: JSON
    fn: Callable[..., object]


ToolFunction = Callable[..., object] | Tool
"""What `Env.tools()` lists: typed functions, or `Tool`s with a ready-made schema."""


@dataclass(frozen=True)
class EndEpisode:
    """What a tool returns to end the episode: `result` is its tool message (rendered as any result
    is: a string as it is, anything else as JSON), recorded in `Episode.messages` for the reward;
    the model never answers it."""

    result: object = ""


class ToolResult(NamedTuple):
    """One call's outcome: the tool message `content`, whether the call succeeded (`ok`), and
    whether the tool ended the episode (`end`, from `EndEpisode`)."""

    content: str
    ok: bool
    end: bool = False


# --- schemas --------------------------------------------------------------------------------------

_SIMPLE: dict[object, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _type_schema(tp: object) -> JSON:
    """JSON schema of one annotation; falls back to msgspec for anything unusual."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _type_schema(args[0])
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _type_schema(rest[0])
        return {"anyOf": [_type_schema(a) for a in rest]}
    if origin is Literal:
        return {"enum": list(args)}
    if tp in (list, tuple) or origin in (list, tuple, Sequence):
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if tp is dict or origin is dict:
        return {"type": "object"}
    schema: JSON = msgspec.json.schema(tp)
    return schema


_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {parameter: description})."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    description: list[str] = []
    params: dict[str, str] = {}
    section = "description"
    current: str | None = None
    arg_indent: int | None = None
    for line in lines:
        stripped = line.strip()
        if re.fullmatch(r"(Args|Arguments|Parameters|Params):", stripped):
            section, current, arg_indent = "args", None, None
            continue
        if re.fullmatch(r"[A-Z][A-Za-z ]*:", stripped) and not line.startswith(" "):
            section, current = "other", None
            continue
        if section == "description":
            description.append(line)
        elif section == "args" and stripped:
            indent = len(line) - len(line.lstrip())
            match = _ARG_LINE.match(line)
            if match and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = match.group(1).lstrip("*")
                params[current] = match.group(2).strip()
            elif current:
                params[current] = f"{params[current]} {stripped}".strip()
    return "\n".join(description).strip(), params


def _call_id_parameter(fn: Callable[..., object]) -> str | None:
    """The name of `fn`'s parameter annotated `CallId`, if any."""
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError):
        return None
    names = [n for n, hint in hints.items() if hint is CallId and n != "return"]
    if len(names) > 1:
        raise TypeError(f"tool {fn!r}: more than one parameter is annotated CallId")
    return names[0] if names else None


def tool_schema(fn: ToolFunction) -> JSON:
    """The OpenAI tool schema of `fn` (`{"type": "function", "function": {...}}`); a `Tool`'s own.

    Raises `TypeError` if a parameter has no annotation or is variadic: the model could not be told
    what to send.
    """
    if isinstance(fn, Tool):
        return _checked_schema(fn.schema)
    name = getattr(fn, "__name__", None)
    if not name:
        raise TypeError(f"tool {fn!r} has no __name__; give it one")
    description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    hints = typing.get_type_hints(fn, include_extras=True)
    properties: dict[str, object] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name!r}: *args/**kwargs cannot be described to a model")
        if pname not in hints:
            raise TypeError(f"tool {name!r}: parameter {pname!r} needs a type annotation")
        hint = hints[pname]
        if hint is CallId:
            continue
        prop = _type_schema(hint)
        text = arg_docs.get(pname)
        if typing.get_origin(hint) is typing.Annotated:
            extra = [m for m in typing.get_args(hint)[1:] if isinstance(m, str)]
            text = text or (extra[0] if extra else None)
        if text:
            prop = {**prop, "description": text}
        properties[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _checked_schema(schema: JSON) -> JSON:
    """A ready-made schema in the `{"type": "function", "function": {...}}` form, checked enough
    that the runner can name the tool and check argument names."""
    inner = schema.get("function", schema) if schema.get("type") == "function" else schema
    if not isinstance(inner, dict) or not isinstance(inner.get("name"), str) or not inner["name"]:
        raise TypeError(f"tool schema {str(schema)[:200]} has no function name")
    parameters = inner.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict):
        raise TypeError(f"tool {inner['name']!r}: 'parameters' must be an object schema")
    return {"type": "function", "function": {**inner, "parameters": parameters}}


# --- execution ------------------------------------------------------------------------------------


def _render_result(value: object) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


@dataclass(frozen=True)
class _Entry:
    """One tool of a ToolBox: what runs, how its arguments are checked, where the call id goes."""

    fn: Callable[..., object]
    check: Callable[[dict[str, object]], dict[str, object]]
    call_id: str | None


class ToolBox:
    """The tools of one episode: their schemas, and calls run against them with a timeout."""

    def __init__(self, tools: Sequence[ToolFunction], *, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._tools: dict[str, _Entry] = {}
        self.schemas: list[JSON] = []
        self._threads = OffLoop(4, name="dora-tool")
        for tool in tools:
            schema = tool_schema(tool)
            function = schema["function"]
            assert isinstance(function, dict)
            name = str(function["name"])
            if name in self._tools:
                raise TypeError(f"two tools are named {name!r}")
            fn = tool.fn if isinstance(tool, Tool) else tool
            call_id = _call_id_parameter(fn)
            if isinstance(tool, Tool):
                parameters = function["parameters"]
                assert isinstance(parameters, dict)
                if call_id is not None and call_id in parameters.get("properties", {}):
                    raise TypeError(f"tool {name!r}: {call_id!r} is both an argument and CallId")
                check = functools.partial(_check_names, parameters)
            else:
                check = functools.partial(_convert, _arguments_struct(tool))
            self._tools[name] = _Entry(fn, check, call_id)
            self.schemas.append(schema)

    def __len__(self) -> int:
        return len(self._tools)

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; return its tool message content, whether it succeeded, and whether the
        tool ended the episode.

        Failures are returned as text for the model ("Error: ..."), never raised; only cancellation
        propagates.
        """
        name = call["function"]["name"]
        entry = self._tools.get(name)
        if entry is None:
            known = ", ".join(sorted(self._tools)) or "none"
            return ToolResult(f"Error: unknown tool {name!r}; available tools: {known}", False)
        try:
            raw = json.loads(call["function"]["arguments"] or "{}")
            if not isinstance(raw, dict):
                raise ValueError(f"arguments must be a JSON object, got {type(raw).__name__}")
            kwargs = entry.check(raw)
        except (json.JSONDecodeError, msgspec.ValidationError, ValueError) as exc:
            return ToolResult(f"Error: bad arguments for {name!r}: {exc}", False)
        if entry.call_id is not None:
            kwargs[entry.call_id] = CallId(call["id"])
        fn = functools.partial(entry.fn, **kwargs)
        try:
            result = await call_hook(self._threads, fn, timeout_s=self.timeout_s)
        except HookTimeout:
            return ToolResult(f"Error: tool {name!r} timed out after {self.timeout_s:g} s", False)
        except Exception as exc:  # the tool's own failure is the model's information, not ours
            return ToolResult(f"Error: tool {name!r} raised {type(exc).__name__}: {exc}", False)
        if isinstance(result, EndEpisode):
            return ToolResult(_render_result(result.result), True, end=True)
        return ToolResult(_render_result(result), True)


def _convert(struct: type[msgspec.Struct], raw: dict[str, object]) -> dict[str, object]:
    """A typed tool's keyword arguments: `raw` validated and converted by its signature."""
    args = msgspec.convert(raw, struct, strict=False)
    kwargs = {f: getattr(args, f) for f in args.__struct_fields__}
    return {k: v for k, v in kwargs.items() if v is not msgspec.UNSET}


def _check_names(parameters: JSON, raw: dict[str, object]) -> dict[str, object]:
    """A `Tool`'s keyword arguments: the required names present, no name the schema lacks (unless
    it allows extra properties). Types are the tool's to check."""
    properties = parameters.get("properties", {})
    assert isinstance(properties, dict)
    required = parameters.get("required", [])
    missing = [p for p in required if p not in raw] if isinstance(required, list) else []
    if missing:
        raise ValueError(f"missing required argument(s) {', '.join(map(repr, missing))}")
    if parameters.get("additionalProperties") is not True:
        unknown = [k for k in raw if k not in properties]
        if unknown:
            known = ", ".join(properties) or "none"
            raise ValueError(f"unknown argument(s) {', '.join(map(repr, unknown))}; known: {known}")
    return dict(raw)


def _arguments_struct(fn: Callable[..., object]) -> type[msgspec.Struct]:
    """A msgspec Struct mirroring `fn`'s parameters, to validate and convert model arguments."""
    hints = typing.get_type_hints(fn)
    fields: list[tuple[str, object, object] | tuple[str, object]] = []
    for pname, param in inspect.signature(fn).parameters.items():
        hint = hints[pname]
        if hint is CallId:
            continue
        if param.default is param.empty:
            fields.append((pname, hint))
        else:
            fields.append((pname, typing.Union[hint, msgspec.UnsetType], msgspec.UNSET))  # noqa: UP007
    name = f"{getattr(fn, '__name__', 'tool')}_arguments"
    return msgspec.defstruct(name, fields, kw_only=True, forbid_unknown_fields=True)
