"""`learn.strategy` refuses what it cannot do correctly, with errors that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.config import load_config
from dora.errors import ConfigError
from dora.learn.parallel import DataParallel, FullySharded, refuse_accelerate_plugins


@pytest.mark.parametrize(
    ("variable", "words"),
    [("ACCELERATE_USE_DEEPSPEED", "--use_deepspeed"), ("ACCELERATE_USE_FSDP", "--use_fsdp")],
)
def test_accelerate_launch_plugins_are_refused_naming_learn_strategy(
    monkeypatch: pytest.MonkeyPatch, variable: str, words: str
) -> None:
    refuse_accelerate_plugins()  # neither set: nothing to refuse
    monkeypatch.setenv(variable, "true")
    with pytest.raises(ConfigError, match=words) as err:
        refuse_accelerate_plugins()
    assert 'learn.strategy = "fsdp"' in str(err.value)


def test_fsdp_without_ranks_is_a_config_error() -> None:
    class OneProcess:
        num_processes = 1

    with pytest.raises(ConfigError, match=r"learn.processes"):
        FullySharded(OneProcess())


def test_a_checkpoint_of_the_other_strategy_is_refused(tmp_path: Path) -> None:
    (tmp_path / "optimizer").mkdir()  # what an fsdp run leaves
    with pytest.raises(ConfigError, match=r"learn.strategy = 'ddp'.*resume with learn.strategy"):
        DataParallel.load_optimizer_file(tmp_path)


def test_strategy_is_checked_at_load() -> None:
    assert load_config(None, ["learn.strategy=fsdp"]).learn.strategy == "fsdp"
    with pytest.raises(ConfigError, match=r"learn\.strategy"):
        load_config(None, ["learn.strategy=deepspeed"])
