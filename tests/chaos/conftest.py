"""Processes a chaos test starts are stopped by their own handles, whatever the test's outcome."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest

from tests.chaos.processes import Owned


@pytest.fixture
def owned() -> Iterator[Owned]:
    started = Owned()
    yield started
    for proc in started.procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    for pid in started.groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
