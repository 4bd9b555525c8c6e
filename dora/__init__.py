"""dora: asynchronous RL for language models with multi-version streaming rollout.

The public API is the names in `__all__`. They are imported on first use (PEP 562), so that
`import dora` and `dora --help` stay instant while torch and transformers load only when needed.
"""

from __future__ import annotations

import importlib

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
    # the scheduling core (docs/scheduling.md)
    "TransferQueue": "dora.core",
    "Orchestrator": "dora.core",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dora' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
