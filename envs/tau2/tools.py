"""tau2 tools as dora tools: a typed Python function per tau2 `Tool`, executed on the episode's own
tau2 `Environment`.

dora's `ToolBox` builds a tool's OpenAI schema from the function's signature and docstring. tau2
tools are methods whose parameters are often pydantic models (airline `Passenger`, `FlightInfo`),
which dora's schema builder and argument checker (msgspec) cannot describe or convert. So each
adapter gets a synthetic signature derived from tau2's *own* JSON schema of the tool: scalars,
enums and lists of scalars keep their exact JSON types; objects and lists of objects become
`dict` / `list[dict]`, and the object's schema (fields, types, descriptions; `$ref`s resolved) is
written into the parameter's description so the model still sees every field. tau2 validates the
arguments itself when the call runs.

Every call goes through `Environment.get_response`, exactly as tau2's orchestrator does, so the
model reads tau2's own result text (errors included: "Error: ..."), the database changes for real,
and each executed call is recorded (`ExecutedCall`) for the evaluator, which replays the trajectory
and checks that the replay returns the same text. Calls the ToolBox rejects before they reach tau2
(unknown tool, arguments of the wrong type) are not recorded: they never touched the database.
"""

from __future__ import annotations

import inspect
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from tau2.data_model.message import ToolCall as Tau2ToolCall
    from tau2.data_model.message import ToolMessage
    from tau2.environment.environment import Environment
    from tau2.environment.tool import Tool

JSONSchema = dict[str, object]
_SCALARS: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool}
# A docstring line like "Note:" at column 0 would start a new section in dora's docstring parser.
_SECTION_LINE = re.compile(r"[A-Z][A-Za-z ]*:")


@dataclass(frozen=True)
class ExecutedCall:
    """A tool call that ran on the tau2 environment, with tau2's own request and response."""

    call: Tau2ToolCall
    response: ToolMessage


def _resolve(schema: object, defs: dict[str, object]) -> object:
    """`schema` with every local `$ref` replaced by its definition (tau2 schemas are not
    recursive)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _resolve(defs.get(ref.removeprefix("#/$defs/"), {}), defs)
        return {k: _resolve(v, defs) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_resolve(v, defs) for v in schema]
    return schema


def _annotation(prop: JSONSchema) -> tuple[object, bool]:
    """(the Python type of one JSON-schema property, whether it is an object the description must
    spell out)."""
    enum = prop.get("enum")
    if isinstance(enum, list) and enum:
        return Literal[tuple(enum)], False
    kind = prop.get("type")
    if isinstance(kind, str) and kind in _SCALARS:
        return _SCALARS[kind], False
    if kind == "array":
        items = prop.get("items")
        if isinstance(items, dict):
            inner, nested = _annotation(items)
            return list[inner], nested  # type: ignore[valid-type]
        return list[Any], True
    if kind == "object":
        return dict[str, object], True
    any_of = prop.get("anyOf")
    if isinstance(any_of, list):
        non_null = [p for p in any_of if isinstance(p, dict) and p.get("type") != "null"]
        if len(non_null) == 1:
            return _annotation(non_null[0])
        if non_null and all(p.get("type") == "object" for p in non_null):
            return dict[str, object], True
    return Any, True


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _docstring(description: str, params: dict[str, str]) -> str:
    lines = [
        f" {line}" if _SECTION_LINE.fullmatch(line.strip()) else line
        for line in description.splitlines()
    ]
    if params:
        lines += ["", "Args:"] + [f"    {name}: {text}" for name, text in params.items()]
    return "\n".join(lines)


def tool_function(
    environment: Environment, tool: Tool, record: Callable[[ExecutedCall], None]
) -> Callable[..., str]:
    """A dora tool function that runs `tool` on `environment` and passes each executed call to
    `record`."""
    from tau2.data_model.message import ToolCall as Tau2ToolCall

    schema = tool.openai_schema["function"]
    assert isinstance(schema, dict)
    parameters = schema.get("parameters", {})
    defs = parameters.get("$defs", {})
    properties: dict[str, JSONSchema] = parameters.get("properties", {})
    required = set(parameters.get("required", []))
    name: str = schema["name"]

    sig_params: list[inspect.Parameter] = []
    annotations: dict[str, object] = {}
    docs: dict[str, str] = {}
    for pname, raw in properties.items():
        prop = _resolve(raw, defs)
        assert isinstance(prop, dict)
        annotation, nested = _annotation(prop)
        text = _one_line(str(prop.get("description", "")))
        if nested:
            shape = {k: v for k, v in prop.items() if k not in ("description", "default")}
            text = f"{text} JSON schema: {json.dumps(shape, separators=(',', ':'))}".strip()
        if pname in required:
            default: object = inspect.Parameter.empty
        else:
            annotation, default = annotation | None, None  # type: ignore[operator]
        annotations[pname] = annotation
        docs[pname] = text or pname
        sig_params.append(
            inspect.Parameter(
                pname, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )

    def call(**arguments: object) -> str:
        request = Tau2ToolCall(id=f"call_{uuid.uuid4().hex[:12]}", name=name, arguments=arguments)
        response = environment.get_response(request)
        record(ExecutedCall(request, response))
        return response.content or ""

    call.__name__ = call.__qualname__ = name
    call.__doc__ = _docstring(str(schema.get("description", "")), docs)
    call.__signature__ = inspect.Signature(sig_params, return_annotation=str)  # type: ignore[attr-defined]
    call.__annotations__ = {**annotations, "return": str}
    return call
