"""Sessions on the embedded engine: a multi-turn episode that sends only what is new samples the
very token ids and log-probs it samples when every call sends the whole context."""

from __future__ import annotations

import pytest

from dora.engine import EngineClient, EngineServer
from dora.instance.session import SESSION_COUNTS
from dora.protocol import Completion, SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPT = [3, 14, 15, 92, 65, 35]
TOOL = [8, 9, 7, 9, 3]


async def _episode(client: EngineClient, name: str, session: str | None) -> list[Completion]:
    """Four turns; each turn's context is the last one's, its answer, and a tool reply."""
    context, out = list(PROMPT), []
    for turn in range(4):
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=100 + turn, ignore_eos=True)
        c = await client.generate(
            context, params, request_id=f"{name}#{turn}", version=0, session=session
        )
        out.append(c)
        context = [*context, *c.token_ids, *TOOL]
    return out


async def test_session_samples_the_same_tokens_as_the_whole_context(
    server: EngineServer, client: EngineClient
) -> None:
    delta = SESSION_COUNTS.delta
    whole = await _episode(client, "w", None)
    kept = await _episode(client, "s", "episode-s")
    assert SESSION_COUNTS.delta == delta + 3  # every turn after the first sent only what is new
    assert "episode-s" in server.sessions
    for a, b in zip(whole, kept, strict=True):
        assert list(a.token_ids) == list(b.token_ids)
        assert list(a.logprobs) == list(b.logprobs)
        assert a.prompt_tokens == b.prompt_tokens
    client.release_session("episode-s")
    await _episode(client, "t", None)  # the release goes out with the next call
    assert "episode-s" not in server.sessions


async def test_session_answer_leaves_out_the_context_it_holds(client: EngineClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "return_token_ids": True, "logprobs": 0}
    plain = await client.http.post_json("/v1/completions", body, 30.0, "generate")
    kept = await client.http.post_json(
        "/v1/completions", {**body, "session_id": "x"}, 30.0, "generate"
    )
    assert plain["choices"][0]["prompt_token_ids"] == PROMPT  # type: ignore[index]
    assert "prompt_token_ids" not in kept["choices"][0]  # type: ignore[index]
