"""The embedded inference engine: continuous batching over a Hugging Face causal LM behind an
OpenAI-compatible aiohttp server, with weight versions, weight loading and request migration.

See docs/engine.md. `EngineServer.start(...)` runs one instance in this process; `python -m
dora.engine` runs one as a process; `EngineClient` (`dora.instance`, re-exported here) talks to
either. The names load on first use (PEP 562): importing `dora.instance.api` or the package alone
does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dora.engine.batcher import BatcherConfig
    from dora.engine.server import EngineServer
    from dora.instance import EngineClient

__all__ = ["BatcherConfig", "EngineClient", "EngineServer"]

_EXPORTS = {
    "BatcherConfig": "dora.engine.batcher",
    "EngineClient": "dora.instance",
    "EngineServer": "dora.engine.server",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dora.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
