"""What each process would be started with: `--dry-run` plans (nothing started, nothing written),
the vLLM command line and environment from the plan and `model.*`, the trainer's and the
engines' CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.config import load_config
from dora.dryrun import trainer_environment
from dora.gpu_plan import PINNED, plan_gpus, visible_devices
from dora.vllm.launcher import server_command, server_env, spec_from_config
from tests.commands import run_dora

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_of_airline_on_8_gpus_plans_4_disjoint_vllm_and_the_trainer_apart(
    tmp_path: Path,
) -> None:
    config = str(REPO / "examples/tau2/airline.toml")
    done = run_dora("run", config, "--dry-run", "--gpus", "8", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    vllm = [line for line in lines if line.strip().startswith("vllm i")]
    assert [line.split()[2] for line in vllm] == [f"CUDA_VISIBLE_DEVICES={i}" for i in range(4)]
    assert all("dtype=bfloat16" in line and "--enforce-eager" not in line for line in vllm)
    (learn,) = [line for line in lines if line.strip().startswith("dora learn")]
    assert "CUDA_VISIBLE_DEVICES=4,5" in learn and "ranks=2" in learn  # 6, 7: the user simulator
    assert "[serve]" in done.stdout  # the resolved config
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_dry_run_refuses_a_plan_that_cannot_fit_naming_the_keys(tmp_path: Path) -> None:
    config = str(REPO / "examples/tau2/airline.toml")
    done = run_dora(
        "run", config, "serve.vllm_tensor_parallel=4", "--dry-run", "--gpus", "2", cwd=tmp_path
    )
    assert done.returncode == 1
    assert "serve.instances" in done.stderr and "serve.vllm_tensor_parallel" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_dry_run_on_this_cpu_machine_prints_the_cpu_plan(tmp_path: Path) -> None:
    done = run_dora("run", str(REPO / "examples/math/config.toml"), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "every process on the CPU" in done.stdout
    assert done.stdout.count("engine i") == 2 and "ranks=1 on cpu" in done.stdout


def test_gpus_without_dry_run_is_refused(tmp_path: Path) -> None:
    done = run_dora("run", str(REPO / "examples/math/config.toml"), "--gpus", "8", cwd=tmp_path)
    assert done.returncode == 2 and "--dry-run" in done.stderr


def _spec(overrides: list[str], visible: tuple[str, ...]):
    config = load_config(None, ["serve.backend=vllm", "serve.vllm_python=py", *overrides])
    plan = plan_gpus(config, visible, {*PINNED, *(o.split("=")[0] for o in overrides)})
    return spec_from_config(config, "/m", plan=plan), plan


def test_vllm_on_gpus_gets_the_dtype_cuda_graphs_memory_and_its_own_devices() -> None:
    spec, plan = _spec(
        ["model.dtype=bfloat16", "serve.vllm_tensor_parallel=2", "serve.gpu_memory_fraction=0.8"],
        visible_devices({"CUDA_VISIBLE_DEVICES": "3,4,5,6,7"}, 5),
    )
    command = server_command(spec, 8000)
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert "--enforce-eager" not in command
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.8"
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert command[command.index("--max-num-seqs") + 1] == "64"
    assert command[command.index("--max-model-len") + 1] == "1024"
    assert server_env(spec, 0)["CUDA_VISIBLE_DEVICES"] == "3,4"
    assert server_env(spec, 1)["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert trainer_environment(plan) == {"CUDA_VISIBLE_DEVICES": "7"}


def test_the_plans_gpus_reach_each_engines_command_line_and_environment() -> None:
    from dora.serve.instances import InstanceSpec, engine_args, engine_env

    config = load_config(None, ["serve.instances=2", "model.dtype=bfloat16"])
    plan = plan_gpus(config, visible_devices({"CUDA_VISIBLE_DEVICES": "4,6,7"}, 3), PINNED)
    spec = InstanceSpec.from_config(config, "/m", plan=plan)
    for slot, gpu in enumerate(("4", "6")):
        args = engine_args(spec, slot)
        assert args[args.index("--device") + 1] == "cuda"
        assert args[args.index("--dtype") + 1] == "bfloat16"
        assert engine_env(spec, slot, {})["CUDA_VISIBLE_DEVICES"] == gpu
    assert trainer_environment(plan) == {"CUDA_VISIBLE_DEVICES": "7"}
    cpu = InstanceSpec.from_config(config, "/m", plan=plan_gpus(config, (), PINNED))
    args = engine_args(cpu, 1)
    assert args[args.index("--device") + 1] == "cpu"
    assert engine_env(cpu, 1, {"CUDA_VISIBLE_DEVICES": "0"})["CUDA_VISIBLE_DEVICES"] == ""


async def test_a_replaced_engine_gets_the_gpu_of_the_one_it_replaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dora.serve import instances
    from dora.serve.instances import InstanceSpec, ProcessPool

    started: list[tuple[str, str]] = []

    async def fake_start(spec: InstanceSpec, instance_id: str, slot: int, procs: dict) -> object:
        started.append((instance_id, instances.engine_env(spec, slot, {})["CUDA_VISIBLE_DEVICES"]))
        return instance_id

    monkeypatch.setattr(instances, "_start_process", fake_start)
    pool = ProcessPool(InstanceSpec(model_dir="/m", devices=("2", "5", "1")))
    await pool.start(3)
    await pool.replace("i1")
    await pool.replace("i3")
    assert started == [("i0", "2"), ("i1", "5"), ("i2", "1"), ("i3", "5"), ("i4", "5")]


def test_enforce_eager_only_where_asked_and_on_the_cpu() -> None:
    spec, _ = _spec(["serve.enforce_eager=true"], ("0", "1", "2"))
    assert "--enforce-eager" in server_command(spec, 8000)
    cpu, plan = _spec([], ())
    assert "--enforce-eager" in server_command(cpu, 8000)
    assert "--gpu-memory-utilization" not in server_command(cpu, 8000)
    assert trainer_environment(plan) == {}


def test_vllm_servers_are_not_forced_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    spec, _ = _spec([], ())
    assert "HF_HUB_OFFLINE" not in server_env(spec, 0)


def test_a_version_too_large_for_base64_over_http_names_the_stage_folder() -> None:
    from dora.vllm.client import MAX_BASE64_BYTES, base64_refusal

    assert base64_refusal(MAX_BASE64_BYTES) is None
    problem = base64_refusal(16 << 30)  # an 8B model in bf16
    assert problem is not None and "serve.stage_dir" in problem and "16.0 GiB" in problem


async def test_the_client_refuses_it_before_touching_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dora.errors import ConfigError
    from dora.vllm import client as vllm_client

    monkeypatch.setattr(vllm_client, "MAX_BASE64_BYTES", 1000)  # not 1 GiB of test memory
    client = vllm_client.VllmClient("http://127.0.0.1:9", stage_dir=None)  # nothing listens
    try:
        with pytest.raises(ConfigError, match=r"serve\.stage_dir"):
            await client.load_weights(1, tensors={"w": ("float32", [500], bytes(2000))})
    finally:
        await client.close()


async def test_attached_servers_without_a_stage_folder_refuse_a_large_model_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dora.errors import ConfigError
    from dora.vllm import client as vllm_client
    from dora.vllm.launcher import vllm_instances

    (tmp_path / "model.safetensors").write_bytes(bytes(4000))
    monkeypatch.setattr(vllm_client, "MAX_BASE64_BYTES", 1000)
    config = load_config(None, ["serve.backend=vllm", "serve.urls=['http://127.0.0.1:9']"])
    plan = plan_gpus(config, (), PINNED)
    with pytest.raises(ConfigError, match=r"serve\.stage_dir"):
        async with vllm_instances(config, str(tmp_path), plan=plan):
            pass


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("learn.devices='0'", "learn.devices"),  # no GPU on this machine
        ("model.path=./no-such-model", "model.path"),
    ],
)
def test_a_run_refused_at_start_writes_nothing_but_its_error(
    tmp_path: Path, setting: str, key: str
) -> None:
    config = str(REPO / "examples/math/config.toml")
    done = run_dora("run", config, setting, "model.warmup_steps=0", cwd=tmp_path)
    assert done.returncode == 1 and key in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no runs/, no cache
