"""The `dora` command answers fast, lists every subcommand, and explains config errors."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dora.cli import BENCHES, COMMANDS, main, run_command
from dora.errors import AllMasked, ConfigError, RunAborted

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "math" / "config.toml")


def test_help_lists_every_command_and_is_fast() -> None:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "dora.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    elapsed = time.perf_counter() - start
    for name in ("serve", "learn", "run", "simulate", "report", "config"):
        assert name in out
    # parsing must not import torch: a cold torch import alone takes over a second here
    assert elapsed < 1.5, f"dora --help took {elapsed:.2f} s"


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys; from dora.cli import build_parser; build_parser(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert "usage: dora" in capsys.readouterr().out


def test_config_show_prints_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", EXAMPLE, "rollout.mode=sync"]) == 0
    out = capsys.readouterr().out
    assert 'mode = "sync"' in out and "staleness = 0" in out


def test_config_errors_exit_nonzero_with_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", EXAMPLE, "learn.lr=abc"]) == 1
    err = capsys.readouterr().err
    assert "learn.lr" in err and "float" in err
    assert main(["config", "show", EXAMPLE, "learn.lrr=1"]) == 1
    assert "did you mean learn.lr" in capsys.readouterr().err


def test_init_model_builds_a_loadable_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["init-model", "tiny", str(tmp_path / "m"), "--layers", "1"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert model.config.num_hidden_layers == 1
    assert tok.decode(tok("2+2=4\n").input_ids) == "2+2=4\n"


def test_errors_of_a_task_group_are_reported_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # serve's parts run in one TaskGroup: a DoraError reaches the command as an ExceptionGroup
    def aborts(args: object) -> int:
        raise ExceptionGroup(
            "serve", [AllMasked("every one of the 64 samples of step 0 was masked")]
        )

    def fails(args: object) -> int:
        raise ExceptionGroup("serve", [ConfigError("serve.instances: expected >= 1, got 0")])

    assert run_command("serve", aborts, None) == RunAborted.exit_code
    assert "dora serve: every one of the 64 samples of step 0 was masked" in capsys.readouterr().err
    assert run_command("serve", fails, None) == 1
    assert "dora serve: serve.instances: expected >= 1, got 0" in capsys.readouterr().err

    def crashes(args: object) -> int:
        raise ExceptionGroup("serve", [ConfigError("x"), KeyError("a bug")])

    with pytest.raises(ExceptionGroup):  # not ours alone: a bug keeps its traceback
        run_command("serve", crashes, None)


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["--learn.lr=1e-5"], "learn.lr=1e-5"),
        (["--learn.lr", "1e-5"], "learn.lr=1e-5"),
        (["--rollout.group_size"], "rollout.group_size=VALUE"),
    ],
)
def test_a_setting_written_as_a_flag_gets_a_key_value_hint(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", EXAMPLE, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err
    assert f"without dashes: {hint}" in err


def test_an_unknown_plain_flag_gets_no_settings_hint(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", EXAMPLE, "--bogus"])
    assert "without dashes" not in capsys.readouterr().err


@pytest.mark.parametrize("which", sorted(BENCHES))
def test_every_benchmark_help_describes_it_in_whole_sentences(
    which: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if which == "trl" and importlib.util.find_spec("trl") is None:
        pytest.skip("the trl extra is not installed")
    module = importlib.import_module(BENCHES[which][0])
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    description = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    assert description.endswith((".", ")")), description
    assert description.count("(") == description.count(")"), description
