"""Fixtures: two tiny models of the same shape (different weights), built once per session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dora.engine import EngineClient, EngineServer
from dora.engine.batcher import BatcherConfig
from dora.models.tiny import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("engine") / "tiny", TinyModelSpec(seed=0))


@pytest.fixture(scope="session")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("engine") / "tiny-b", TinyModelSpec(seed=1))


@pytest.fixture
async def server(tiny_model: Path) -> AsyncIterator[EngineServer]:
    async with EngineServer.start(
        tiny_model, version=0, threads=1, config=BatcherConfig(max_running=64)
    ) as srv:
        yield srv


@pytest.fixture
async def client(server: EngineServer) -> AsyncIterator[EngineClient]:
    async with EngineClient(server.url, timeout_s=60) as c:
        yield c
