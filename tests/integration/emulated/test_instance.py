"""Emulated instances over their real HTTP API, through dora's own EngineClient."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from dora.costs import apply_overrides, preset
from dora.emulated.instance import EmulatedInstance, ScaledClock
from dora.emulated.model import EmulatedModel
from dora.emulated.server import EmulatedServer
from dora.errors import RequestError, VersionMismatch
from dora.instance import EngineClient
from dora.protocol import SamplingParams

pytestmark = pytest.mark.timeout(60)

SETUP = apply_overrides(preset("paper-64"), ["response_median=300", "response_max=2000"])
PROMPT = list(range(10, 60))


@contextlib.asynccontextmanager
async def cluster(n: int, *, scale: float = 1e-4) -> AsyncIterator[list[EngineClient]]:
    loop = asyncio.get_running_loop()
    clock = ScaledClock(scale, loop)
    model = EmulatedModel(SETUP, seed=0, vocab_size=100, first_token=7)
    runners, clients = [], []
    try:
        for i in range(n):
            inst = EmulatedInstance(name=f"i{i}", setup=SETUP, clock=clock, model=model, version=0)
            runner = web.AppRunner(EmulatedServer(inst).app, access_log=None)
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            clients.append(EngineClient(f"http://{host}:{port}", timeout_s=30))
        yield clients
    finally:
        for c in clients:
            await c.close()
        for r in runners:
            await r.cleanup()


def long_index() -> int:
    """A sample index whose answer to PROMPT is long enough to interrupt halfway."""
    model = EmulatedModel(SETUP, seed=0, vocab_size=100, first_token=7)
    return next(i for i in range(1000) if 400 <= model.plan(f"p/{i}#1", PROMPT).length <= 600)


async def test_lengths_are_a_function_of_prompt_and_sample() -> None:
    params = SamplingParams(max_tokens=5000)
    async with cluster(2) as (a, b):
        first = await a.generate(PROMPT, params, request_id="g0/3#1", version=0)
        again = await b.generate(PROMPT, params, request_id="g9/3#1", version=0)
        other = await a.generate(PROMPT, params, request_id="g0/4#1", version=0)
    assert list(first.token_ids) == list(again.token_ids) and list(first.logprobs) == list(
        again.logprobs
    )
    assert first.token_ids != other.token_ids
    assert first.finish_reason == "stop" and 1 <= len(first.token_ids) <= SETUP.response_max
    assert all(7 <= t < 100 for t in first.token_ids)
    assert list(first.versions) == [0] * len(first.token_ids)
    assert all(lp <= 0 for lp in first.logprobs)


async def test_an_interrupted_response_continues_where_it_stopped() -> None:
    params = SamplingParams(max_tokens=5000)
    i = long_index()
    async with cluster(2, scale=0.1) as (a, b):  # 400 tokens: 0.8 s of decoding
        whole = await b.generate(PROMPT, params, request_id=f"w/{i}#1", version=0)
        call = asyncio.create_task(a.generate(PROMPT, params, request_id=f"x/{i}#1", version=0))
        await asyncio.sleep(0.2)  # some tokens sampled, not all
        cut = await a.abort(f"x/{i}#1")
        aborted = await call
        assert aborted.finish_reason == "abort" and list(aborted.token_ids) == list(cut.token_ids)
        assert 0 < len(cut.token_ids) < len(whole.token_ids)
        rest = await b.generate(
            PROMPT + cut.token_ids, params, request_id=f"x/{i}#2", version=0
        )  # resubmitted with the tokens so far, as partial rollout does
    assert [*cut.token_ids, *rest.token_ids] == list(whole.token_ids)


async def test_export_and_import_move_a_request_without_losing_tokens() -> None:
    params = SamplingParams(max_tokens=5000)
    i = long_index()
    async with cluster(2, scale=0.1) as (a, b):
        whole = await b.generate(PROMPT, params, request_id=f"w/{i}#1", version=0)
        call = asyncio.create_task(a.generate(PROMPT, params, request_id=f"m/{i}#1", version=0))
        await asyncio.sleep(0.2)
        exported = await a.export_request(f"m/{i}#1")
        await call
        assert exported.kv and 0 < len(exported.token_ids) < len(whole.token_ids)
        # held until its import as typed arrays: the collector walks no item of them
        tokens = (exported.prompt_ids, exported.token_ids, exported.logprobs, exported.versions)
        assert all(len(gc.get_referents(t)) <= 1 for t in tokens)
        moved = await b.import_request(exported)
    assert list(moved.token_ids) == list(whole.token_ids)


async def test_versions_loads_and_bad_requests() -> None:
    async with cluster(1) as (a,):
        with pytest.raises(VersionMismatch):
            await a.generate(PROMPT, SamplingParams(), request_id="v/0#1", version=1)
        out = await a.load_weights(1, path="/nowhere/needed")
        assert out["version"] == 1 and out["previous_version"] == 0
        done = await a.generate(PROMPT, SamplingParams(max_tokens=3), request_id="v/0#2", version=1)
        assert list(done.versions) == [1, 1, 1] and done.finish_reason == "length"
        with pytest.raises(RequestError, match="unknown field"):
            await a.http.post_json(
                "/v1/completions", {"prompt": PROMPT, "max_token": 3}, 5, "generate"
            )
        with pytest.raises(RequestError, match="unknown request_id"):
            await a.abort("nobody")
        health = await a.health()
        assert health["version"] == 1
        metrics = await a.metrics()
        assert metrics["running"] == 0 and metrics["generated_tokens"] > 0


async def test_a_load_that_keeps_running_requests_switches_their_next_tokens() -> None:
    """Mode inflight: the load lands under a running request, which is not aborted and goes on
    where it was; its tokens before the load carry the old version, the rest the new one, and
    the text is the same as a request that ran on one version."""
    params = SamplingParams(max_tokens=5000)
    i = long_index()
    async with cluster(2, scale=0.1) as (a, b):
        whole = await b.generate(PROMPT, params, request_id=f"w/{i}#1", version=0)
        call = asyncio.create_task(a.generate(PROMPT, params, request_id=f"k/{i}#1"))
        await asyncio.sleep(0.2)  # some tokens sampled, not all
        out = await a.load_weights(1, path="/nowhere/needed", mode="keep")
        assert out["aborted"] == [] and out["version"] == 1
        kept = await call
    assert kept.finish_reason == "stop" and list(kept.token_ids) == list(whole.token_ids)
    versions = list(kept.versions)
    switch = versions.index(1)
    assert 0 < switch < len(versions) and versions == [0] * switch + [1] * (len(versions) - switch)


async def test_call_cpu_counts_each_generate_by_part() -> None:
    from dora.instance import CALL_CPU

    before_calls, before = CALL_CPU.calls, dict(CALL_CPU.seconds)
    async with cluster(1) as (client,):
        for i in range(3):
            await client.generate(
                PROMPT, SamplingParams(max_tokens=50), request_id=f"c/{i}#1", version=0
            )
    assert CALL_CPU.calls - before_calls == 3
    for part in ("request", "answer"):
        assert CALL_CPU.seconds[part] > before.get(part, 0.0), part
    assert set(CALL_CPU.per_call_us()) >= {"request", "answer"}
