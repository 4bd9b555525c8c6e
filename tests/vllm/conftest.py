"""Fixtures for the vLLM backend tests: the tiny model, two perturbed versions of its weights, and
two vLLM servers of it, shared by the tests of a module (a start costs 25-60 s on two cores) and
stopped through their handles at the module's end, also when a test fails. Tests run in the
session's event loop (`loop_scope="session"`), the loop the servers' clients belong to."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from vllm_helpers import MAX_MODEL_LEN, perturbed

from dora.models.tiny import TinyModelSpec, build_tiny_model
from dora.serve.instances import InstanceHandle
from dora.vllm.launcher import SCRATCH_MAX_LEN, SCRATCH_PREFIX, VllmSpec, start_vllm


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", TinyModelSpec(seed=0))


@pytest.fixture(scope="session")
def weights_v1(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed(tiny_model, tmp_path_factory.mktemp("vllm") / "v1", scale=0.5, seed=1)


@pytest.fixture(scope="session")
def weights_v2(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed(tiny_model, tmp_path_factory.mktemp("vllm") / "v2", scale=0.5, seed=2)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_servers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[InstanceHandle]]:
    spec = VllmSpec(
        model_dir=str(tiny_model),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=16,
        log_dir=str(tmp_path_factory.mktemp("vllm-logs")),
        start_timeout_s=180,
        request_timeout_s=60,
        control_timeout_s=60,
    )
    async with start_vllm(spec, 2) as handles:
        yield handles


@pytest.fixture
def own_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A new temporary folder for this process and the servers it starts (`TMPDIR`), removed at
    the end. Short, so that the servers' scratch folders go inside it (vLLM's IPC socket paths
    must fit in 107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="t"))
    if len(str(folder)) + len(SCRATCH_PREFIX) + 10 > SCRATCH_MAX_LEN:
        folder.rmdir()
        folder = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
