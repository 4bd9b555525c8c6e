"""The `dora` script finds the user's modules (`env.cls`, `data.source`) in the working directory,
as `python -m dora.cli` does: a new user's `myenv.py` next to their config just works."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

USER_MODULE = """
from dora import Env


class UserEnv(Env):
    def __init__(self) -> None:
        raise TypeError("usermod was imported from the working directory")
"""


def test_the_dora_script_imports_env_modules_from_the_working_directory(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "dora"
    if not script.exists():
        pytest.skip("no dora console script next to this Python")
    (tmp_path / "usermod.py").write_text(USER_MODULE)
    (tmp_path / "config.toml").write_text(
        '[model]\npath = "tiny"\nwarmup_steps = 0\n[env]\ncls = "usermod:UserEnv"\n'
        f'[log]\nrun_dir = "{tmp_path / "run"}"\nprogress = false\n'
    )
    proc = subprocess.run(
        [str(script), "serve", "config.toml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=50,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 1
    assert "usermod was imported from the working directory" in proc.stderr, proc.stderr[-2000:]
