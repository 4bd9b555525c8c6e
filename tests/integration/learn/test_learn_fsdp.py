"""`dora learn` with `learn.strategy = "fsdp"` on two gloo ranks (FSDP2 on CPU), driven by the
stand-in for serve with fixed groups (the same data in every run, so runs can be compared).

- The sharded trainer computes the same steps as one process (losses, gradient norms).
- Killed after a checkpoint and resumed, it ends with the weights and the optimizer state of an
  uninterrupted run of the same steps, and right after loading the checkpoint every rank holds
  exactly its share of the saved parameters and optimizer state.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from learn_standin import StandIn
from test_learn_loop import fixed_groups, run_fixed, write_config

from dora.learn.checkpoint import CheckpointInfo, latest_checkpoint
from dora.models import TinyModelSpec, build_tiny_model
from dora.protocol import Durable, Hello, StepDone, WeightChunk, WeightsReady

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

PROBE = Path(__file__).with_name("fsdp_probe.py")
STEPS, EVERY, UPDATES = 4, 2, 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", TinyModelSpec(seed=1))


@pytest.mark.two_ranks
async def test_fsdp_on_two_ranks_matches_one_process(tmp_path: Path, tiny_dir: Path) -> None:
    one = await run_fixed(tmp_path / "one", tiny_dir, processes=1)
    fsdp = await run_fixed(tmp_path / "fsdp", tiny_dir, processes=2, strategy="fsdp")
    assert [x["ranks"] for x in one + fsdp] == [1] * 3 + [2] * 3
    for a, b in zip(one, fsdp, strict=True):
        for key in ("loss", "grad_norm", "entropy", "tokens", "ratio_mean", "is_weight_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    print([round(x["loss"], 5) for x in one], [round(x["loss"], 5) for x in fsdp])


def _start(config: Path, address: str, *, resume: bool = False) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "dora.cli", "learn", str(config), *(["--resume"] if resume else [])],
        env={**os.environ, "DORA_SERVE_ADDRESS": address},
        start_new_session=True,  # its own process group: torchrun and both ranks die together
    )


async def _wait(proc: subprocess.Popen[bytes], timeout_s: float = 120) -> int:
    return await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout_s)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _running(text: str) -> list[int]:
    """Processes whose command line mentions `text`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if text in proc.joinpath("cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


async def _gone(text: str, timeout_s: float = 20) -> list[int]:
    """Wait until no process mentions `text`; what is left then."""
    for _ in range(int(timeout_s * 10)):
        if not _running(text):
            return []
        await asyncio.sleep(0.1)
    return _running(text)


def _dcp(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    """A DCP folder as one flat dict of full tensors ("optimizer/state/<param>/<key>")."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}/{key}" if prefix else str(key), inner)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=True))
    return flat


def _weights(ckpt: CheckpointInfo) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(ckpt.model_dir / "model.safetensors")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b) and a
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.two_ranks
async def test_fsdp_resumed_after_a_kill_ends_like_an_uninterrupted_run(
    tmp_path: Path, tiny_dir: Path
) -> None:
    settings = {
        "steps": STEPS,
        "checkpoint_every": EVERY,
        "processes": 2,
        "strategy": "fsdp",
        "lr": 5e-3,
        "off_policy": "decoupled",
        "updates_per_step": UPDATES,
        "micro_batch_tokens": 64,
        "weight_transport": "filesystem",
    }
    straight_cfg = write_config(tmp_path / "straight", tiny_dir, **settings)
    killed_cfg = write_config(tmp_path / "killed", tiny_dir, **settings)
    standin = StandIn(tiny_dir, on_policy=False)
    make = fixed_groups(standin)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # the uninterrupted run
        procs.append(_start(straight_cfg, standin.link.address))
        straight = await standin.serve(range(STEPS), make)
        assert await _wait(procs[-1]) == 0
        await standin.drain()
        standin.close()

        # the same run, killed (SIGKILL: no exit checkpoint) once step 2 is trained, one step
        # past its last checkpoint (step 1)
        standin = StandIn(tiny_dir, on_policy=False)
        procs.append(_start(killed_cfg, standin.link.address))
        first = await standin.serve(range(3), make)
        assert [d.step for d in first.of(Durable)] == [1]
        assert len(_running(str(killed_cfg))) == 4  # dora learn, torchrun, two ranks
        os.kill(procs[-1].pid, signal.SIGKILL)  # dora learn alone: the rest dies with it
        procs[-1].wait()
        assert await _gone(str(killed_cfg)) == [], "ranks outlived the killed trainer"
        standin.close()

        # resumed from step 1: steps 2 and 3 again
        standin = StandIn(tiny_dir, on_policy=False)
        procs.append(_start(killed_cfg, standin.link.address, resume=True))
        resumed = await standin.serve(range(2, STEPS), make)
        assert await _wait(procs[-1]) == 0
        await standin.drain()
        hello = resumed.of(Hello)[0]
        assert (hello.incarnation, hello.step) == (1, 2)
        assert not resumed.of(WeightChunk)  # filesystem transport
        assert [w.version for w in resumed.of(WeightsReady)] == [2, 3, 4]

        a = latest_checkpoint(tmp_path / "straight" / "run")
        b = latest_checkpoint(tmp_path / "killed" / "run")
        assert a is not None and b is not None and a.step == b.step == STEPS - 1
        weights = _max_diff(_weights(a), _weights(b))
        optimizer_a = _dcp(a.path / "optimizer", tmp_path / "a.pt")
        optimizer_b = _dcp(b.path / "optimizer", tmp_path / "b.pt")
        optimizer = _max_diff(optimizer_a, optimizer_b)
        print(f"max |straight - resumed|: weights {weights:.3g}, optimizer state {optimizer:.3g}")
        assert weights <= 1e-6 and optimizer <= 1e-6
        from transformers import AutoModelForCausalLM

        params = len(list(AutoModelForCausalLM.from_pretrained(a.model_dir).parameters()))
        assert sum(k.endswith("/exp_avg_sq") for k in optimizer_a) == params  # every parameter
        loss = {d.step: d.metrics["loss"] for d in straight.of(StepDone)}
        for d in resumed.of(StepDone):
            assert d.metrics["loss"] == pytest.approx(loss[d.step], rel=1e-6, abs=1e-9)

        # what each rank holds once it has loaded the checkpoint it resumed from (step 1)
        resumed_from = b.path.with_name("step-000001")
        saved = _dcp(resumed_from / "optimizer", tmp_path / "saved.pt")
        saved_weights = _weights(
            CheckpointInfo(step=1, version=2, incarnation=0, path=resumed_from)
        )
        probe = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                str(PROBE),
                str(resumed_from),
                str(tmp_path / "probe"),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=120,
            check=False,
        )
        assert probe.returncode == 0
        for rank in range(2):
            held = torch.load(tmp_path / "probe" / f"rank{rank}.pt", weights_only=True)
            for key, value in held.items():
                kind, name, *field = key.split("/")
                if kind == "param":
                    full = saved_weights[name]
                else:
                    full = saved[f"optimizer/state/{name}/{field[0]}"]
                share = full if full.dim() == 0 else torch.chunk(full, 2, dim=0)[rank]
                assert torch.equal(value, share), (rank, key)
            assert sum(k.startswith("param/") for k in held) == params
            assert sum(k.endswith("/exp_avg") for k in held) == params
            steps = [float(v) for k, v in held.items() if k.endswith("/step")]
            assert steps and all(x == UPDATES * EVERY for x in steps)  # steps 0 and 1
    finally:
        for proc in procs:
            _stop(proc)
        standin.close()
