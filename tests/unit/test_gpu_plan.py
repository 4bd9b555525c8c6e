"""The GPU planner: every layout fills the visible GPUs without overlap, explicit settings win,
and an impossible plan is refused naming the keys."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.config import load_config
from dora.cpu_plan import given_keys
from dora.errors import ConfigError
from dora.gpu_plan import COLOCATED_MEMORY_FRACTION, plan_gpus, visible_devices

AIRLINE = "examples/tau2/airline.toml"


def _plan(overrides: list[str], gpus: int, path: str | None = None):
    config = load_config(path, overrides)
    raw: dict[str, object] = {}
    if path:
        from pathlib import Path

        from dora.config_file import read_config_file

        raw = read_config_file(Path(path))
    return plan_gpus(config, visible_devices({}, gpus), given_keys(raw, overrides))


def test_airline_on_8_gpus_puts_4_instances_and_the_trainer_on_disjoint_gpus() -> None:
    plan = _plan([], 8, AIRLINE)
    assert plan.instances == (("0",), ("1",), ("2",), ("3",))
    assert plan.trainer == ("4", "5")  # 6 and 7 run the user simulator
    assert plan.trainer_processes == 2


def test_with_nothing_said_8_gpus_are_filled_half_inference_half_training() -> None:
    plan = _plan(["serve.backend=vllm"], 8)
    assert plan.instances == (("0",), ("1",), ("2",), ("3",))
    assert plan.trainer == ("4", "5", "6", "7")


def test_airline_with_tp_4_on_2_gpus_is_refused_naming_the_keys() -> None:
    with pytest.raises(ConfigError) as err:
        _plan(["serve.vllm_tensor_parallel=4"], 2, AIRLINE)
    for key in ("serve.instances", "serve.vllm_tensor_parallel", "run.colocate"):
        assert key in str(err.value)


def test_no_gpu_is_the_cpu_plan() -> None:
    plan = _plan([], 0, "examples/math/config.toml")
    assert not plan.on_gpu
    assert plan.instances == ((), ())
    assert plan.trainer == ()


def test_embedded_instances_get_a_gpu_each_and_the_trainer_the_rest() -> None:
    plan = _plan([], 4)
    assert plan.instances == (("0",), ("1",))
    assert plan.trainer == ("2", "3")
    pinned = _plan(["serve.vllm_devices=['3', '1']", "learn.devices='0,2'"], 4)
    assert pinned.instances == (("3",), ("1",))
    assert pinned.trainer == ("0", "2")
    assert _plan(pinned.overrides(), 4) == pinned


def test_embedded_instances_colocated_share_every_gpu_with_the_trainer() -> None:
    plan = _plan(["serve.instances=2", "run.colocate=true"], 2)
    assert plan.instances == (("0",), ("1",))
    assert plan.trainer == ("0", "1")


def test_an_embedded_engine_spans_one_gpu_only() -> None:
    with pytest.raises(ConfigError, match=r"serve\.vllm_tensor_parallel"):
        _plan(["serve.vllm_tensor_parallel=2"], 4)


def test_emulated_and_attached_instances_take_no_gpu() -> None:
    assert _plan(["serve.backend=emulated"], 4).instances == ((), ())
    attached = _plan(["serve.urls=['http://10.0.0.1:8000']"], 4)
    assert attached.instances == ((),)
    assert attached.trainer == ("0", "1", "2", "3")


def test_colocated_trainer_shares_the_instances_gpus_with_less_memory_for_vllm() -> None:
    plan = _plan(["serve.backend=vllm", "serve.instances=2", "run.colocate=true"], 2)
    assert plan.instances == (("0",), ("1",))
    assert plan.trainer == ("0", "1")
    assert plan.memory_fraction == COLOCATED_MEMORY_FRACTION


def test_explicit_devices_win_and_map_to_the_visible_ids() -> None:
    config = load_config(
        None,
        [
            "serve.backend=vllm",
            "serve.vllm_tensor_parallel=2",
            "serve.vllm_devices=['5,7', '3,2']",
            "learn.devices='4'",
        ],
    )
    visible = visible_devices({"CUDA_VISIBLE_DEVICES": "2,3,4,5,7"}, 5)
    plan = plan_gpus(config, visible, {"serve.vllm_devices", "learn.devices"})
    assert plan.instance_env(0) == "5,7"
    assert plan.instance_env(1) == "3,2"
    assert plan.trainer_env() == "4"


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["serve.vllm_devices=['0', '0']"], ["serve.vllm_devices"]),
        (["serve.vllm_devices=['0', '9']"], ["serve.vllm_devices[1]", "does not exist"]),
        (
            [
                "serve.vllm_tensor_parallel=2",
                "serve.vllm_devices=['0,1', '2']",
                "run.colocate=true",
            ],
            ["serve.vllm_devices[1]", "serve.vllm_tensor_parallel"],
        ),
        (["serve.vllm_devices=['0', '1']", "learn.devices='1'"], ["learn.devices", "colocate"]),
        (["serve.instances=3", "serve.vllm_devices=['0', '1']"], ["serve.instances"]),
        (["learn.processes=3", "learn.devices='2,3'"], ["learn.processes", "learn.devices"]),
        (["serve.instances=4"], ["serve.instances", "run.colocate"]),
        (["serve.vllm_devices=['0', '1', '2', '3']"], ["serve.vllm_devices", "run.colocate"]),
    ],
)
def test_bad_plans_are_refused_naming_the_keys(overrides: list[str], keys: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _plan(["serve.backend=vllm", *overrides], 4)
    for key in keys:
        assert key in str(err.value)


def test_gpu_keys_without_a_gpu_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"learn\.devices"):
        _plan(["learn.devices='0'"], 0)


def test_overrides_of_a_plan_pin_the_same_plan() -> None:
    plan = _plan([], 8, AIRLINE)
    again = _plan(plan.overrides(), 8, AIRLINE)
    assert again == plan


@settings(max_examples=200, deadline=None)
@given(
    gpus=st.integers(1, 16),
    tp=st.sampled_from([1, 2, 4, 8]),
    instances=st.none() | st.integers(1, 8),
    processes=st.none() | st.integers(1, 8),
    colocate=st.booleans(),
)
def test_every_plan_that_is_made_holds(
    gpus: int, tp: int, instances: int | None, processes: int | None, colocate: bool
) -> None:
    overrides = ["serve.backend=vllm", f"serve.vllm_tensor_parallel={tp}"]
    overrides += [f"run.colocate={str(colocate).lower()}", "rollout.group_size=2"]
    if instances is not None:
        overrides.append(f"serve.instances={instances}")
    if processes is not None:
        overrides.append(f"learn.processes={processes}")
    try:
        plan = _plan(overrides, gpus)
    except ConfigError as exc:
        # refused only when it cannot fit, naming a key to change
        asked = (instances or 1) * tp + (0 if colocate else (processes or 1))
        assert asked > gpus or (processes or 0) > gpus, exc
        assert "serve." in str(exc) or "learn." in str(exc)
        return
    used = [g for group in plan.instances for g in group]
    assert len(used) == len(set(used)), "instances share a GPU"
    assert all(len(group) == tp for group in plan.instances)
    assert set(used) | set(plan.trainer) <= set(plan.visible)
    assert plan.trainer, "the trainer has a GPU"
    if instances is not None:
        assert len(plan.instances) == instances
    if processes is not None:
        assert len(plan.trainer) == processes
    if not colocate:
        assert not set(used) & set(plan.trainer), "trainer on an instance's GPU"
    else:
        assert plan.memory_fraction == COLOCATED_MEMORY_FRACTION
    if instances is None and processes is None and not colocate:
        assert len(used) + len(plan.trainer) > gpus - tp, "GPUs left idle"


def test_bf16_on_a_cpu_without_it_is_refused_naming_the_key() -> None:
    from dora.gpu_plan import cpu_bf16_refusal

    config = load_config(None, ["model.dtype=bfloat16"])
    cpu = _plan(["model.dtype=bfloat16"], 0)
    problem = cpu_bf16_refusal(config, cpu, frozenset({"avx2", "fma"}))
    assert problem is not None and "model.dtype" in problem and "trainer" in problem
    assert cpu_bf16_refusal(config, cpu, frozenset({"avx512_bf16"})) is None
    assert cpu_bf16_refusal(config, cpu, None) is None  # unknown CPU: not refused
    vllm = ["model.dtype=bfloat16", "serve.backend=vllm"]
    on_gpus = _plan(vllm, 4)
    assert cpu_bf16_refusal(load_config(None, vllm), on_gpus, frozenset({"avx2"})) is None
    fp32 = load_config(None, [])
    assert cpu_bf16_refusal(fp32, _plan([], 0), frozenset({"avx2"})) is None


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path) -> None:
    from dora.dryrun import cpu_flags

    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert "bf16" in (cpu_flags(arm) or ())
    assert cpu_flags(tmp_path / "missing") is None
