"""dora: asynchronous RL for language models with multi-version streaming rollout.

The public API is the names in `__all__`. They are imported on first use (PEP 562), so that
`import dora` and `dora --help` stay instant while torch and transformers load only when needed;
type checkers read the same names from the `TYPE_CHECKING` imports below. `_EXPORTS`, those
imports and `__all__` name the same things (tests/unit/test_public_api.py checks it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker sees: the real classes, not `__getattr__`'s `object`
    from dora.config import DoraConfig, load_config
    from dora.core import Orchestrator, TransferQueue
    from dora.env import (
        AgentEnv,
        Env,
        Episode,
        Message,
        PromptStream,
        Reply,
        Reward,
        ScorerPool,
        SingleTurnEnv,
        Task,
        agent_env,
        load_env,
        load_object,
    )
    from dora.episode import (
        EpisodeLimits,
        GroupFailed,
        PinnedSampler,
        Sampler,
        masked_sample,
        run_episode,
        run_group,
    )
    from dora.errors import ConfigError, DataError, DoraError, EnvError, ServerError
    from dora.models import TinyModelSpec, build_tiny_model
    from dora.protocol import Completion, Group, Sample, SamplingParams
    from dora.render import ChatRenderer
    from dora.tool_calls import ParsedTurn, ToolCall, parse_tool_calls
    from dora.tools import CallId, EndEpisode, Tool, ToolBox, ToolResult, tool_schema

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "DoraConfig": "dora.config",
    "load_config": "dora.config",
    "DoraError": "dora.errors",
    "ConfigError": "dora.errors",
    "EnvError": "dora.errors",
    "DataError": "dora.errors",
    "ServerError": "dora.errors",
    "Sample": "dora.protocol",
    "Group": "dora.protocol",
    "SamplingParams": "dora.protocol",
    "Completion": "dora.protocol",
    "TinyModelSpec": "dora.models",
    "build_tiny_model": "dora.models",
    # the environment API (docs/environments.md)
    "Env": "dora.env",
    "SingleTurnEnv": "dora.env",
    "Task": "dora.env",
    "Episode": "dora.env",
    "Message": "dora.env",
    "Reply": "dora.env",
    "Reward": "dora.env",
    "PromptStream": "dora.env",
    "ScorerPool": "dora.env",
    "load_env": "dora.env",
    "load_object": "dora.env",
    "tool_schema": "dora.tools",
    "Tool": "dora.tools",
    "CallId": "dora.tools",
    "EndEpisode": "dora.tools",
    "ToolBox": "dora.tools",
    "ToolResult": "dora.tools",
    "ToolCall": "dora.tool_calls",
    "ParsedTurn": "dora.tool_calls",
    "parse_tool_calls": "dora.tool_calls",
    # running episodes against an inference instance
    "Sampler": "dora.episode",
    "PinnedSampler": "dora.episode",
    "EpisodeLimits": "dora.episode",
    "GroupFailed": "dora.episode",
    "run_episode": "dora.episode",
    "run_group": "dora.episode",
    "masked_sample": "dora.episode",
    "ChatRenderer": "dora.render",
    # an agent's own loop against an OpenAI-compatible endpoint (docs/environments.md)
    "AgentEnv": "dora.env",
    "agent_env": "dora.env",
    # the scheduling core (docs/scheduling.md)
    "TransferQueue": "dora.core",
    "Orchestrator": "dora.core",
}

__all__ = [
    "AgentEnv",
    "CallId",
    "ChatRenderer",
    "Completion",
    "ConfigError",
    "DataError",
    "DoraConfig",
    "DoraError",
    "EndEpisode",
    "Env",
    "EnvError",
    "Episode",
    "EpisodeLimits",
    "Group",
    "GroupFailed",
    "Message",
    "Orchestrator",
    "ParsedTurn",
    "PinnedSampler",
    "PromptStream",
    "Reply",
    "Reward",
    "Sample",
    "Sampler",
    "SamplingParams",
    "ScorerPool",
    "ServerError",
    "SingleTurnEnv",
    "Task",
    "TinyModelSpec",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolResult",
    "TransferQueue",
    "agent_env",
    "build_tiny_model",
    "load_config",
    "load_env",
    "load_object",
    "masked_sample",
    "parse_tool_calls",
    "run_episode",
    "run_group",
    "tool_schema",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dora' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
