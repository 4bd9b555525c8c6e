"""Session-wide test settings: nothing a test builds lands outside its temporary directories."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="session")
def _model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Prepared initial models (dora.models.prepare) go to a per-session cache, not ~/.cache.
    Subprocesses started by tests (dora run, serve, learn) inherit it through the environment."""
    cache = tmp_path_factory.mktemp("dora-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DORA_CACHE", str(cache))
        yield cache


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Two trainer ranks take a GPU each where there are GPUs: with one, `dora learn` refuses."""
    import torch

    if torch.cuda.device_count() != 1:
        return
    skip = pytest.mark.skip(reason="two trainer ranks need two GPUs on a machine with GPUs")
    for item in items:
        if item.get_closest_marker("two_ranks"):
            item.add_marker(skip)
