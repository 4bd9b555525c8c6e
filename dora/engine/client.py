"""The old import path of the engine's HTTP client: `EngineClient` is `dora.instance`'s (the
instance interface's client, which loads no torch); this module only re-exports it."""

from dora.instance import EngineClient, ExportedRequest

__all__ = ["EngineClient", "ExportedRequest"]
