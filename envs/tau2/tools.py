"""tau2 tools as dora tools: a `dora.tools.Tool` per tau2 `Tool`, executed on the episode's own tau2
`Environment`.

The schema the model sees is tau2's own (`Tool.openai_schema`, what tau2's agent sends to its LLM),
with local `$ref`s inlined and pydantic's `title` keys dropped: many models do not follow `$ref`,
and the titles only repeat the names. tau2 tools take pydantic models (airline `Passenger`,
`FlightInfo`), so dora checks only the argument names; tau2 validates the values when the call
runs and answers a bad one with its own error text, as its orchestrator does.

Every call goes through `Environment.get_response`, exactly as tau2's orchestrator does, so the
model reads tau2's own result text (errors included: "Error: ..."), the database changes for real,
and each executed call is kept (`ExecutedCall`) under the id of the model's call, for the
evaluator, which replays the trajectory and checks that the replay returns the same text. Calls
the ToolBox rejects before they reach tau2 (unknown tool, missing or unknown argument names) are
not recorded: they never touched the database.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dora import CallId, Tool

if TYPE_CHECKING:
    from tau2.data_model.message import ToolCall as Tau2ToolCall
    from tau2.data_model.message import ToolMessage
    from tau2.environment.environment import Environment
    from tau2.environment.tool import Tool as Tau2Tool

JSONSchema = dict[str, object]


@dataclass(frozen=True)
class ExecutedCall:
    """A tool call that ran on the tau2 environment, with tau2's own request and response."""

    call: Tau2ToolCall
    response: ToolMessage


def _resolve(schema: object, defs: dict[str, object]) -> object:
    """`schema` with every local `$ref` replaced by its definition and no `title` keys (tau2
    schemas are not recursive)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _resolve(defs.get(ref.removeprefix("#/$defs/"), {}), defs)
        # a pydantic `title` is a string; a parameter named "title" has a schema (a dict)
        return {
            k: _resolve(v, defs)
            for k, v in schema.items()
            if k != "$defs" and not (k == "title" and isinstance(v, str))
        }
    if isinstance(schema, list):
        return [_resolve(v, defs) for v in schema]
    return schema


def tool_schema(tool: Tau2Tool) -> JSONSchema:
    """tau2's OpenAI schema of `tool`, self-contained (see the module doc)."""
    function = tool.openai_schema["function"]
    assert isinstance(function, dict)
    parameters = function.get("parameters", {})
    defs = parameters.get("$defs", {}) if isinstance(parameters, dict) else {}
    return {
        "type": "function",
        "function": {
            "name": function["name"],
            "description": function.get("description", ""),
            "parameters": _resolve(parameters, defs),
        },
    }


def tool_function(environment: Environment, tool: Tau2Tool, ran: dict[str, ExecutedCall]) -> Tool:
    """A dora tool that runs `tool` on `environment` and keeps each executed call in `ran`, under
    the model's call id."""
    from tau2.data_model.message import ToolCall as Tau2ToolCall

    schema = tool_schema(tool)
    name = tool.name

    def call(call_id: CallId, **arguments: object) -> str:
        request = Tau2ToolCall(id=call_id, name=name, arguments=arguments)
        response = environment.get_response(request)
        ran[call_id] = ExecutedCall(request, response)
        return response.content or ""

    return Tool(schema=schema, fn=call)
