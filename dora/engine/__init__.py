"""The embedded inference engine: continuous batching over a Hugging Face causal LM behind an
OpenAI-compatible aiohttp server, with weight versions, weight loading and request migration.

See docs/engine.md. `EngineServer.start(...)` runs one instance in this process; `python -m
dora.engine` runs one as a process; `EngineClient` talks to either.
"""

from dora.engine.batcher import BatcherConfig
from dora.engine.client import EngineClient
from dora.engine.server import EngineServer

__all__ = ["BatcherConfig", "EngineClient", "EngineServer"]
