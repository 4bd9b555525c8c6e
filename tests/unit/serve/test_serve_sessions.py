"""The router names each episode's lease as its session on the instance that runs it, and releases
the session when the episode ends, moves to another instance, parks or fails."""

from __future__ import annotations

import pytest

from dora.instance import Capabilities
from dora.protocol import Completion, SamplingParams
from dora.serve.router import Router

pytestmark = pytest.mark.timeout(10)

PARAMS = SamplingParams(max_tokens=4)


class SessionInstance:
    """Answers at once with two tokens; records the session of each call and each release."""

    capabilities = Capabilities(kv_migration=False, lora_versions=False, sessions=True)

    def __init__(self) -> None:
        self.sessions: list[str | None] = []
        self.released: list[str] = []

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        version: int | None,
        session: str | None = None,
    ) -> Completion:
        self.sessions.append(session)
        return Completion(
            request_id=request_id,
            token_ids=[1, 2],
            logprobs=[-0.1, -0.2],
            versions=[0, 0],
            finish_reason="stop",
        )

    def release_session(self, session: str) -> None:
        self.released.append(session)


def _router(**instances: SessionInstance) -> Router:
    router = Router(kv_migration=False, sessions=True)
    for name, inst in instances.items():
        router.add_instance(name, inst)  # type: ignore[arg-type]
    return router


async def test_session_follows_the_lease_and_is_released_when_it_moves_or_ends() -> None:
    a, b = SessionInstance(), SessionInstance()
    router = _router(a=a, b=b)
    router.open("g/0", version=0, instance="a")
    sampler = router.sampler("g/0")
    await sampler.generate([5, 6], PARAMS)
    await sampler.generate([5, 6, 1, 2, 7], PARAMS)
    assert a.sessions == ["g/0", "g/0"] and a.released == []
    router.move("g/0", "b")  # the context stays behind: released there
    assert a.released == ["g/0"]
    await sampler.generate([5, 6, 1, 2, 7, 1, 2, 8], PARAMS)
    assert b.sessions == ["g/0"]
    assert router.close("g/0")
    assert b.released == ["g/0"] and a.released == ["g/0"]


async def test_session_released_when_the_lease_parks_or_fails() -> None:
    a = SessionInstance()
    router = _router(a=a)
    router.open("g/1", version=0, instance="a")
    await router.sampler("g/1").generate([5, 6], PARAMS)
    router.park("g/1")
    assert a.released == ["g/1"]
    router.resume("g/1", "a", 0)
    await router.sampler("g/1").generate([5, 6, 1, 2], PARAMS)
    router.fail("g/1", "no instance")
    assert a.released == ["g/1", "g/1"]
    router.close("g/1")
    assert a.released == ["g/1", "g/1"]  # nothing held any more: nothing to release twice
