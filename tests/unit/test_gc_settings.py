"""The collector settings of dora's long-running processes, and the finished-request memory that
stays out of the collector's heap."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import msgspec

from dora.gc_settings import YOUNG_THRESHOLD
from dora.instance.wire import RecentCompletions
from dora.protocol import Completion


def test_settle_heap_freezes_the_startup_objects_and_widens_the_young_generation() -> None:
    script = (
        "import gc, json; import dora.gc_settings as h; before = gc.get_freeze_count(); "
        "h.settle_heap(); "
        "print(json.dumps([before, gc.get_freeze_count(), gc.get_threshold()]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    before, frozen, threshold = json.loads(out.stdout)
    assert before == 0
    assert frozen > 1000  # the interpreter's and dora's own objects
    assert threshold[0] == YOUNG_THRESHOLD


_CLOCK_SCRIPT = """
import asyncio, gc, json, weakref
from dora.gc_settings import collector_clock, settle_heap

class Node:
    pass

def cycle():
    node = Node()
    node.me = node
    return node

async def main():
    settle_heap()
    out = {}
    async with collector_clock(young_every_s=0.01, full_every_s=FULL):
        out["automatic"] = gc.isenabled()
        frozen = gc.get_freeze_count()
        young = weakref.ref(cycle())  # garbage at once: the next young collection frees it
        kept = cycle()  # survives a young collection, then is frozen
        await asyncio.sleep(0.1)
        out["young_freed"] = young() is None
        out["survivors_frozen"] = gc.get_freeze_count() > frozen
        old = weakref.ref(kept)
        del kept  # garbage now, but frozen: only a full collection frees it
        await asyncio.sleep(0.3)
        out["old_freed"] = old() is None
    out["automatic_after"] = gc.isenabled()
    print(json.dumps(out))

asyncio.run(main())
"""


def _clock(full_every_s: float) -> dict[str, bool]:
    script = _CLOCK_SCRIPT.replace("FULL", repr(full_every_s))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    result: dict[str, bool] = json.loads(out.stdout)
    return result


def test_the_collector_clock_collects_the_young_and_freezes_what_survives() -> None:
    out = _clock(full_every_s=3600)
    assert out["automatic"] is False and out["automatic_after"] is True
    assert out["young_freed"] and out["survivors_frozen"]
    assert out["old_freed"] is False  # a cycle that died frozen waits for the full collection


def test_the_collector_clock_frees_frozen_cycles_at_its_full_collection() -> None:
    assert _clock(full_every_s=0.15)["old_freed"] is True


def _completion(i: int, n: int) -> Completion:
    return Completion(
        request_id=f"r{i}",
        token_ids=list(range(n)),
        logprobs=[-0.5] * n,
        versions=[i] * n,
        finish_reason="length",
        prompt_tokens=3,
    )


def _as_lists(completions: list[Completion] | None) -> list[Completion] | None:
    """Answers hold typed arrays; compare them with completions built from lists."""
    if completions is None:
        return None
    return [
        msgspec.structs.replace(
            c, token_ids=list(c.token_ids), logprobs=list(c.logprobs), versions=list(c.versions)
        )
        for c in completions
    ]


def test_recent_completions_answer_the_latest_requests_only() -> None:
    recent = RecentCompletions(3)
    for i in range(5):
        recent.add(f"r{i}", [_completion(i, 4)])
    assert "r0" not in recent and "r1" not in recent
    assert recent.get("r0") is None
    assert _as_lists(recent.get("r4")) == [_completion(4, 4)]
    recent.add("r2", [_completion(2, 4)])  # re-added: now the newest, r3 goes next
    recent.add("r5", [_completion(5, 4)])
    assert "r3" not in recent and "r2" in recent


def test_recent_completions_keep_no_token_objects_in_the_collectors_heap() -> None:
    recent = RecentCompletions(64)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(64):
        recent.add(f"r{i}", [_completion(i, 5_000)])
    gc.collect()
    # as objects, these would be 256 tracked containers holding 960,000 items for each collection
    assert len(gc.get_objects()) - before < 16
    assert _as_lists(recent.get("r7")) == [_completion(7, 5_000)]
