"""`learn.weight_transport = "nccl"`: accepted where vLLM's NCCL weight transfer can work as
designed, refused at load (or at the trainer's start) everywhere else, with errors that name the
keys and say why."""

from __future__ import annotations

import sys

import pytest
import torch

from dora.config import load_config
from dora.cpu_plan import given_keys
from dora.errors import ConfigError
from dora.gpu_plan import plan_gpus, visible_devices

NCCL = ["learn.weight_transport=nccl", "serve.backend=vllm", "rollout.mode=one_step_off"]


def test_nccl_transport_is_accepted_with_vllm_in_the_modes_whose_loads_empty_an_instance() -> None:
    for mode in ("sync", "one_step_off", "partial", "dora"):
        config = load_config(None, [*NCCL, f"rollout.mode={mode}"])
        assert config.learn.weight_transport == "nccl"
        assert config.learn.nccl_address == "127.0.0.1" and config.learn.nccl_port == 0


def test_nccl_transport_without_the_vllm_backend_is_refused_naming_the_keys() -> None:
    for backend in ("embedded", "emulated"):
        with pytest.raises(ConfigError, match=r"learn.weight_transport = 'nccl'.*serve.backend"):
            load_config(None, [*NCCL, f"serve.backend={backend}"])


def test_nccl_transport_in_inflight_mode_is_refused_saying_why() -> None:
    """vLLM cannot run inflight at all: its loads would run under calls the broadcast empties."""
    with pytest.raises(ConfigError, match=r"rollout.mode = 'inflight' is invalid with serve.backe"):
        load_config(None, [*NCCL, "rollout.mode=inflight"])


def test_nccl_transport_with_lora_or_the_emulated_trainer_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model.lora.rank"):
        load_config(None, [*NCCL, "model.lora.rank=8"])
    with pytest.raises(ConfigError, match=r"emulate.trainer"):
        load_config(None, [*NCCL, "emulate.trainer=true"])


def test_nccl_transport_needs_gpus_in_the_plan() -> None:
    config = load_config(None, NCCL)
    keys = given_keys({}, NCCL)
    with pytest.raises(ConfigError, match=r"learn.weight_transport = 'nccl'.*no GPU is visible"):
        plan_gpus(config, visible_devices({}, 0), keys)
    plan = plan_gpus(config, visible_devices({}, 4), keys)
    assert plan.trainer and all(plan.instances)


def test_nccl_trainer_without_a_gpu_or_vllm_is_refused_at_its_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dora.learn.nccl import nccl_sender

    config = load_config(None, NCCL)
    sent: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        nccl_sender(config, sent.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators.pynccl", None)
    with pytest.raises(ConfigError, match=r"dora\[vllm\]"):
        nccl_sender(config, sent.append)
    assert sent == []  # refused before anything reached serve


def test_nccl_servers_start_with_the_weight_transfer_config() -> None:
    import json

    from dora.vllm.launcher import server_command, spec_from_config

    config = load_config(None, [*NCCL, "serve.vllm_python=py"])
    plan = plan_gpus(config, visible_devices({}, 4), given_keys({}, NCCL))
    command = server_command(spec_from_config(config, "/m", plan=plan), 8000)
    flag = command[command.index("--weight-transfer-config") + 1]
    assert json.loads(flag) == {"backend": "nccl"}  # else vLLM answers 500 on every route
    inline = load_config(None, ["serve.backend=vllm", "serve.vllm_python=py"])
    plan = plan_gpus(inline, visible_devices({}, 4), given_keys({}, []))
    assert "--weight-transfer-config" not in server_command(
        spec_from_config(inline, "/m", plan=plan), 8000
    )
