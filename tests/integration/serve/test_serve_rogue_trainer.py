"""A rogue peer on the trainer link of a live `dora serve`: it gets nothing and changes nothing.

Any local process can connect to the link's port. A peer says `Hello` with an incarnation serve
could not have issued (lower than the current, the current one again, far above it, `2**62`) or a
roll-back to a step before the durable one, with the run's token and without it. Whether the real
trainer is connected or gone (crashed, its restart not yet there), the rogue gets no group and no
answer, serve does not roll back, its journal does not grow with the attempts, and the run
finishes: the real trainer (or its restart) trains every step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path

import msgspec
import pytest
from serve_helpers import on_free_port, serve_in_process
from serve_trainer import ToyTrainer, check_resumed, dying_trainer, restart_config, resumed_trainer

from dora.config import DoraConfig, ServeConfig
from dora.errors import ServerTimeout
from dora.link import LearnLink
from dora.protocol import Hello, Refused

pytestmark = pytest.mark.timeout(180)

TOKEN = "the-run-secret"
STEPS, B, K = 8, 2, 2
JOURNAL_BOUND_BYTES = 1 << 20
"""A run of 8 steps journals a few KB; one roll-back per claimed incarnation would be far more."""

CLAIMS = [(-1, 0), (0, 0), (1, 0), (1, 3), (1000, 3), (2**62, 3), (2**62, 2**40)]
"""(incarnation, step) of the rogue hellos while the first trainer (incarnation 0) is connected."""

CLAIMS_TRAINER_GONE = [(-1, 4), (0, 4), (1, 0), (1, 2), (1, 1000), (1000, 4), (2**62, 4)]
"""... and after it died with step 3 durable: the current incarnation again, a roll-back to before
the durable step, past what serve filled, and incarnations serve could not have issued."""


def _with_token(config: DoraConfig) -> DoraConfig:
    return msgspec.structs.replace(config, serve=msgspec.structs.replace(config.serve, token=TOKEN))


Rogue = tuple[LearnLink, str]
"""A rogue's link and the token its hello carried."""


def _rogues(address: str, claims: list[tuple[int, int]], tokens: tuple[str, ...]) -> list[Rogue]:
    rogues = []
    for incarnation, step in claims:
        for token in tokens:
            rogue = LearnLink(address)
            rogue.send(Hello(role="learn", incarnation=incarnation, step=step, token=token))
            rogues.append((rogue, token))
    return rogues


def _check_rogues_got_nothing(rogues: list[Rogue]) -> None:
    """Nothing but, to a holder of the token, the reason it was refused (`Refused`)."""
    for rogue, token in rogues:
        try:
            got = rogue.recv(timeout_s=0.2, waiting_for="anything from serve")
        except ServerTimeout:
            continue
        assert token and isinstance(got, Refused), got


async def _check_unmoved(
    serve: asyncio.Future[object], run_dir: Path, *, journal_before: int
) -> None:
    """A while after the rogues' hellos (a spin or a crash would show by then), serve runs on,
    has not rolled back, and its journal did not grow with them."""
    await asyncio.sleep(2.0)
    assert not serve.done(), "serve is still running the run"
    assert _rollbacks(run_dir) == []
    assert _journal_bytes(run_dir) - journal_before < JOURNAL_BOUND_BYTES


async def _stop(serve: asyncio.Future[object], rogues: list[Rogue]) -> None:
    serve.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await serve
    for rogue, _ in rogues:
        rogue.close()


def _rollbacks(run_dir: Path) -> list[dict[str, object]]:
    records = [json.loads(x) for x in (run_dir / "rollout.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "rollback"]


def _journal_bytes(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in (run_dir / "journal").rglob("*") if p.is_file())


async def test_rogue_trainer_while_the_trainer_is_connected(
    tmp_path: Path, long_tail_model: Path
) -> None:
    config = _with_token(restart_config(tmp_path, long_tail_model, steps=STEPS, batch_size=B, k=K))
    config, address = on_free_port(config)
    reached, go = threading.Event(), threading.Event()

    def pause_at_step_2(step: int) -> None:
        if step == 2:
            reached.set()
            go.wait(60)

    trainer = ToyTrainer(
        address,
        model_dir=long_tail_model,
        steps=STEPS,
        batch_size=B,
        durable_every=2,
        on_trained=pause_at_step_2,
        link_config=ServeConfig(token=TOKEN),
    )
    trainer.start()
    serve = asyncio.ensure_future(serve_in_process(config, run_dir=tmp_path))
    rogues: list[Rogue] = []
    try:
        assert await asyncio.to_thread(reached.wait, 90), "the trainer reached step 2"
        before = _journal_bytes(tmp_path)
        rogues = _rogues(address, CLAIMS, tokens=("", TOKEN))
        await _check_unmoved(serve, tmp_path, journal_before=before)
        go.set()
        report = await asyncio.wait_for(serve, 120)
        await asyncio.to_thread(trainer.join)
        _check_rogues_got_nothing(rogues)
    finally:
        go.set()
        await _stop(serve, rogues)

    assert trainer.trained == list(range(STEPS)) and trainer.shutdown
    assert _rollbacks(tmp_path) == []
    assert _journal_bytes(tmp_path) < JOURNAL_BOUND_BYTES
    assert report.steps == STEPS  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_rogue_trainer_while_the_trainer_is_gone(
    tmp_path: Path, long_tail_model: Path
) -> None:
    config = _with_token(restart_config(tmp_path, long_tail_model, steps=STEPS, batch_size=B, k=K))
    config, address = on_free_port(config)
    first = dying_trainer(address, long_tail_model, steps=STEPS, batch_size=B)
    first.link_config = ServeConfig(token=TOKEN)
    first.start()
    serve = asyncio.ensure_future(serve_in_process(config, run_dir=tmp_path))
    rogues: list[Rogue] = []
    try:
        await asyncio.to_thread(first.join, 60)
        assert first.trained == [0, 1, 2, 3, 4]
        before = _journal_bytes(tmp_path)
        # Even holding the run's token, a peer gets in only as the next incarnation, resuming
        # after a durable step at a step serve filled.
        rogues = _rogues(address, CLAIMS_TRAINER_GONE, tokens=(TOKEN, ""))
        await _check_unmoved(serve, tmp_path, journal_before=before)
        second = resumed_trainer(address, long_tail_model, steps=STEPS, batch_size=B)
        second.link_config = ServeConfig(token=TOKEN)
        second.start()
        report = await asyncio.wait_for(serve, 120)
        await asyncio.to_thread(second.join)
        _check_rogues_got_nothing(rogues)
    finally:
        await _stop(serve, rogues)

    check_resumed(first, second, steps=STEPS, k=K)
    rollbacks = _rollbacks(tmp_path)
    assert len(rollbacks) == 1 and rollbacks[0]["step"] == 3, "the real restart only"
    assert report.steps == STEPS  # type: ignore[attr-defined]
