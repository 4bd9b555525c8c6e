"""`dora learn` driven by a stand-in for `dora serve` over the real link, on a real tiny model.

The stand-in samples groups from its copy of the policy, rewards digits, and loads every version
the trainer publishes; the policy must move towards digits, and versions, acks, checkpoints and
`--resume` must follow the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from learn_standin import (
    StandIn,
    completion_logprob,
    learn_args,
    run_learn_in_thread,
    sample_group,
)

from dora.errors import ProtocolError, TrainingError
from dora.learn.checkpoint import latest_checkpoint
from dora.learn.publish import state_dict_from_chunks
from dora.models import TinyModelSpec, build_tiny_model
from dora.protocol import (
    Durable,
    Group,
    Hello,
    Refused,
    Shutdown,
    StepDone,
    WeightChunk,
    WeightsReady,
)

pytestmark = pytest.mark.timeout(240)

G, B, NEW = 8, 2, 10
REWARDED = "0123456789"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", TinyModelSpec(seed=1))


def exists(paths: list[str]) -> list[bool]:
    return [Path(p).is_dir() for p in paths]


def write_config(tmp: Path, model_dir: Path, **learn: object) -> Path:
    def toml(v: object) -> str:
        return (
            json.dumps(v)
            if isinstance(v, str)
            else str(v).lower()
            if isinstance(v, bool)
            else str(v)
        )

    lines = [
        "[model]",
        f'path = "{model_dir}"',
        "[rollout]",
        'mode = "sync"',
        f"group_size = {G}",
        f"batch_size = {B}",
        f"max_tokens = {NEW}",
        "[learn]",
        *(f"{k} = {toml(v)}" for k, v in learn.items()),
        "[log]",
        f'run_dir = "{tmp / "run"}"',
    ]
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def on_policy_groups(standin: StandIn, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    sent: dict[str, Group] = {}

    def make(step: int, version: int) -> list[Group]:
        groups = [
            sample_group(
                standin.model,
                standin.tokenizer,
                gid=f"s{step}g{i}",
                version=version,
                group_size=G,
                new_tokens=NEW,
                generator=gen,
            )
            for i in range(B)
        ]
        sent.update((g.id, g) for g in groups)
        if step == 1:  # a duplicate of a group step 0 already trained: dropped
            groups.insert(1, sent["s0g0"])
        if step == 2:  # a failed episode: stays in its group, no gradient
            first = msgspec.structs.replace(groups[0].samples[0], masked=True)
            groups[0] = msgspec.structs.replace(groups[0], samples=[first, *groups[0].samples[1:]])
        if step == 3:  # labelled one version older: staleness 1
            groups[0] = msgspec.structs.replace(groups[0], version=version - 1)
        return groups

    return make


async def test_policy_learns_the_reward_with_acks_checkpoints_and_resume(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin = StandIn(tiny_dir)
    monkeypatch.setenv("DORA_SERVE_ADDRESS", standin.link.address)
    config = write_config(
        tmp_path,
        tiny_dir,
        steps=4,
        lr=5e-3,
        checkpoint_every=2,
        weight_transport="filesystem",
        off_policy="tis",
        micro_batch_tokens=128,
    )
    before = completion_logprob(standin.model, standin.tokenizer, REWARDED)
    make = on_policy_groups(standin)
    try:
        learner = await run_learn_in_thread(learn_args(config))
        record = await standin.serve(range(4), make)
        assert await asyncio.wait_for(learner, 60) == 0
        await standin.drain()

        assert record.hello is not None
        assert (record.hello.incarnation, record.hello.step) == (0, 0)
        ready = record.of(WeightsReady)
        assert [(w.version, w.incarnation) for w in ready] == [(v, 0) for v in (1, 2, 3, 4)]
        assert all(w.path.startswith(str(tmp_path / "run" / "weights")) for w in ready)
        # K = 0: versions below 4 - K - 2 are pruned once version 4 is out
        assert exists([w.path for w in ready]) == [False, True, True, True]
        done = record.of(StepDone)
        assert [d.step for d in done] == [0, 1, 2, 3]
        assert [d.step for d in record.of(Durable)] == [1, 3]
        assert isinstance(record.messages[-1], Shutdown)
        kinds = [
            (type(m).__name__, getattr(m, "step", getattr(m, "version", None)))
            for m in record.messages
        ]
        for t in range(4):  # version t + 1 is published before step t is acknowledged
            assert kinds.index(("WeightsReady", t + 1)) < kinds.index(("StepDone", t))
        m = [d.metrics for d in done]
        assert m[1]["duplicate_groups"] == 1 and m[1]["groups"] == B
        assert m[2]["masked_samples"] == 1 and m[2]["tokens"] == (B * G - 1) * NEW
        assert (m[3]["staleness_max"], m[3]["staleness_mean"]) == (1, 1 / B)
        assert m[0]["staleness_max"] == 0 and m[0]["version"] == 1
        for key in ("loss", "reward_mean", "entropy", "clip_fraction", "ratio_mean", "grad_norm"):
            assert all(key in x for x in m)
        assert all(x["step_time_s"] > 0 and x["grad_norm"] > 0 for x in m)
        print({k: round(v, 3) for k, v in m[-1].items()})

        # the checkpoint is a Hugging Face folder with its tokenizer
        ckpt = latest_checkpoint(tmp_path / "run")
        assert ckpt is not None and (ckpt.step, ckpt.version, ckpt.incarnation) == (3, 4, 0)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        AutoTokenizer.from_pretrained(ckpt.model_dir)
        AutoModelForCausalLM.from_pretrained(ckpt.model_dir)

        # --resume: incarnation 1 continues at step 4 with version 5
        resumed = learn_args(config, "learn.steps=6", resume=True)
        learner = await run_learn_in_thread(resumed)
        record = await standin.serve(range(4, 6), make)
        assert await asyncio.wait_for(learner, 60) == 0
        await standin.drain()
        assert record.hello is not None
        assert (record.hello.incarnation, record.hello.step) == (1, 4)
        new = [(w.version, w.incarnation) for w in record.of(WeightsReady)[4:]]
        assert new == [(4, 1), (5, 1), (6, 1)]  # the starting version again, then new ones
        assert [(d.step, d.incarnation) for d in record.of(Durable)[2:]] == [(5, 1)]

        # the policy moved towards the rewarded behaviour
        final = latest_checkpoint(tmp_path / "run")
        assert final is not None and final.step == 5
        trained = AutoModelForCausalLM.from_pretrained(final.model_dir)
        after = completion_logprob(trained, standin.tokenizer, REWARDED)
        rewards = [d.metrics["reward_mean"] for d in record.of(StepDone)]
        print(f"log p({REWARDED!r}) {before:.2f} -> {after:.2f}; rewards {rewards}")
        assert after > before + 2.0
    finally:
        standin.close()


async def test_inline_weights_and_shutdown_from_serve(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inline chunks rebuild the published weights exactly; serve's `Shutdown` ends the run after a
    checkpoint of the last trained step. Decoupled PPO, two updates per step, KL, sequence-level,
    and the zero-variance filter."""
    standin = StandIn(tiny_dir)
    monkeypatch.setenv("DORA_SERVE_ADDRESS", standin.link.address)
    config = write_config(
        tmp_path,
        tiny_dir,
        steps=5,
        checkpoint_every=10,
        weight_transport="inline",
        off_policy="decoupled",
        updates_per_step=2,
        aggregation="sequence",
        kl_coef=0.05,
        micro_batch_tokens=64,
        filter_zero_variance=True,
    )
    make = on_policy_groups(standin)

    def with_flat_group(step: int, version: int) -> list[Group]:
        groups = make(step, version)
        flat = [msgspec.structs.replace(s, reward=0.5) for s in groups[0].samples]
        return [*groups, msgspec.structs.replace(groups[0], id=f"flat{step}", samples=flat)]

    try:
        learner = await run_learn_in_thread(learn_args(config))
        record = await standin.serve(range(5), with_flat_group, shutdown_after=1)
        assert await asyncio.wait_for(learner, 60) == 0
        await standin.drain()
        assert [d.step for d in record.of(StepDone)] == [0, 1]
        assert [d.step for d in record.of(Durable)] == [1]  # the exit checkpoint
        assert not record.of(Shutdown)  # serve stopped the run; the trainer does not echo it
        chunks = [c for c in record.of(WeightChunk) if c.version == 2]
        published = state_dict_from_chunks(chunks)
        ckpt = latest_checkpoint(tmp_path / "run")
        assert ckpt is not None and ckpt.step == 1
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(ckpt.model_dir).state_dict()
        assert set(published) == set(saved)
        for name, tensor in saved.items():
            torch.testing.assert_close(published[name], tensor, rtol=0, atol=0)
        m = record.of(StepDone)[1].metrics
        assert m["kl"] > 0 and m["grad_norm"] > 0
        assert (m["filtered_groups"], m["groups"]) == (1, B + 1)  # the flat group, counted
        assert m["tokens"] == B * G * NEW
    finally:
        standin.close()


def fixed_groups(standin: StandIn):  # type: ignore[no-untyped-def]
    """The same groups every step (fresh ids), so two runs see identical data."""
    base = on_policy_groups(standin, seed=3)(0, 0)

    def make(step: int, version: int) -> list[Group]:
        return [
            msgspec.structs.replace(g, id=f"s{step}g{i}", version=version)
            for i, g in enumerate(base)
        ]

    return make


async def run_fixed(
    tmp: Path, tiny_dir: Path, processes: int, **learn: object
) -> list[dict[str, float]]:
    settings: dict[str, object] = {
        "steps": 3,
        "lr": 5e-3,
        "off_policy": "decoupled",
        "updates_per_step": 2,
        "micro_batch_tokens": 64,
    }
    config = write_config(tmp, tiny_dir, **{**settings, **learn, "processes": processes})
    standin = StandIn(tiny_dir, on_policy=False)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dora.cli",
            "learn",
            str(config),
            env={**os.environ, "DORA_SERVE_ADDRESS": standin.link.address},
        )
        record = await standin.serve(range(3), fixed_groups(standin))
        assert await asyncio.wait_for(proc.wait(), 120) == 0
        return [d.metrics for d in record.of(StepDone)]
    finally:
        standin.close()


@pytest.mark.slow
@pytest.mark.two_ranks
async def test_two_gloo_ranks_match_one_process(tmp_path: Path, tiny_dir: Path) -> None:
    one = await run_fixed(tmp_path / "one", tiny_dir, processes=1)
    two = await run_fixed(tmp_path / "two", tiny_dir, processes=2)
    assert [x["ranks"] for x in one + two] == [1] * 3 + [2] * 3
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm", "entropy", "tokens", "ratio_mean", "is_weight_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    print([round(x["loss"], 5) for x in one], [round(x["loss"], 5) for x in two])


@pytest.mark.slow
@pytest.mark.two_ranks
async def test_rank_zero_timeout_stops_every_rank(tmp_path: Path, tiny_dir: Path) -> None:
    """Serve goes quiet: rank 0's deadline expires and rank 1 stops too, well before any
    collective timeout (which is learn.recv_timeout_s + 300 s)."""
    config = write_config(tmp_path, tiny_dir, steps=2, processes=2)
    overrides = ["learn.recv_timeout_s=3"]
    standin = StandIn(tiny_dir)
    env = {
        **os.environ,
        "DORA_SERVE_ADDRESS": standin.link.address,
    }
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dora.cli",
            "learn",
            str(config),
            *overrides,
            env=env,
            stderr=asyncio.subprocess.PIPE,
        )
        hello = await standin.recv()
        assert hello.__class__.__name__ == "Hello"
        _, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode != 0
        assert b"the groups of step 0" in err
    finally:
        standin.close()


async def test_a_non_finite_loss_stops_the_step_without_publishing(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN reward that reached the trainer anyway (serve masks them) makes the loss NaN: the
    step stops with an error naming the step, the group and the cause, and publishes nothing."""
    standin = StandIn(tiny_dir)
    monkeypatch.setenv("DORA_SERVE_ADDRESS", standin.link.address)
    config = write_config(tmp_path, tiny_dir, steps=2, weight_transport="filesystem")
    gen = torch.Generator().manual_seed(0)

    def make(step: int, version: int) -> list[Group]:
        groups = [
            sample_group(
                standin.model,
                standin.tokenizer,
                gid=f"s{step}g{i}",
                version=version,
                group_size=G,
                new_tokens=NEW,
                generator=gen,
            )
            for i in range(B)
        ]
        bad = msgspec.structs.replace(groups[1].samples[0], reward=float("nan"))
        groups[1] = msgspec.structs.replace(groups[1], samples=[bad, *groups[1].samples[1:]])
        return groups

    serving: asyncio.Future[object] | None = None
    try:
        learner = await run_learn_in_thread(learn_args(config))
        serving = asyncio.ensure_future(standin.serve(range(1), make))
        with pytest.raises(TrainingError) as info:
            await asyncio.wait_for(learner, 60)
        message = str(info.value)
        assert "step 0: the loss of a micro-batch of group(s) ['s0g1'] is nan" in message
        assert "advantages are not finite (a reward was NaN" in message, message
        assert "no version is published" in message
        assert not [m for m in standin.record.messages if isinstance(m, WeightsReady)]
    finally:
        if serving is not None:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
        standin.close()


async def test_a_refused_resume_rewinds_the_incarnation_so_the_next_resume_is_admitted(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every start of `dora learn --resume` takes the last started incarnation + 1, also one that
    serve never heard (it was down, or refused it): the marker then runs ahead of serve, whose
    check admits only the next one. Serve answers such a hello with its own incarnation; the
    trainer stops with the reason and rewinds the marker, so `--resume` again is admitted."""
    standin = StandIn(tiny_dir)
    monkeypatch.setenv("DORA_SERVE_ADDRESS", standin.link.address)
    config = write_config(tmp_path, tiny_dir, steps=1, lr=5e-3, weight_transport="filesystem")
    marker = tmp_path / "run" / "checkpoints" / "incarnation"
    marker.parent.mkdir(parents=True)
    marker.write_text("3")  # serve admitted incarnation 1; attempts 2 and 3 never reached it
    serving = 1

    def admit(hello: Hello) -> str | None:
        if hello.incarnation == serving + 1:
            return None
        return f"serve is at incarnation {serving}: a restart is the next one"

    def answer(hello: Hello, why: str) -> Refused:
        return Refused(reason=why, incarnation=serving)

    async def hear_hellos() -> Hello:
        while True:
            message = await standin.link.recv(admit=admit, answer=answer)
            if isinstance(message, Hello):
                return message

    try:
        hearing = asyncio.ensure_future(hear_hellos())
        learner = await run_learn_in_thread(learn_args(config, resume=True))
        with pytest.raises(ProtocolError, match="serve is at incarnation 1") as refused:
            await asyncio.wait_for(learner, 60)
        assert "now holds serve's incarnation 1" in str(refused.value)
        assert marker.read_text().strip() == "1"
        assert not hearing.done()

        learner = await run_learn_in_thread(learn_args(config, resume=True))
        hello = await asyncio.wait_for(hearing, 60)
        assert (hello.incarnation, hello.step) == (2, 0)
        await standin.link.send(Shutdown(reason="test stops serve"))
        assert await asyncio.wait_for(learner, 60) == 0
    finally:
        standin.close()
