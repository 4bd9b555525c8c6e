"""A verifiers multi-turn tool environment (classic API: a `load_environment` returning a
`vf.ToolEnv`) and a verifiers.v1 tool taskset, each written as a verifiers user writes one
(tests/unit/env/verifiers_calc_env.py, tests/unit/env/verifiers_calc.py, saved next to the config
as an installed one would be importable), trained a few steps by `dora run` through
envs.verifiers. Checked against the engine's own record of every request: the ids trained on are,
call for call, what the engine was prompted with and sampled, each call of an episode on its
group's one version."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.env.exact import TINY_RUN, check_token_exact, run_logged, step_metrics
from tests.unit.env.needs_verifiers import skip_unless_verifiers

skip_unless_verifiers("verifiers")

ROOT = Path(__file__).resolve().parents[3]
TASKSET = ROOT / "tests" / "unit" / "env" / "verifiers_calc.py"
ENVIRONMENT = ROOT / "tests" / "unit" / "env" / "verifiers_calc_env.py"

pytestmark = pytest.mark.timeout(300)

CLASSIC_CONFIG = (
    TINY_RUN
    + """
[env]
cls = "envs.verifiers:VerifiersEnv"
kwargs = { environment = "verifiers_calc_env", kind = "KIND", max_turns = 3 }
"""
)

CONFIG = (
    TINY_RUN
    + """
[env]
cls = "envs.verifiers:VerifiersEnv"
kwargs = { taskset = "verifiers_calc", max_turns = 3 }
"""
)


def test_verifiers_tool_taskset_trains_token_exact_on_one_version(tmp_path: Path) -> None:
    (tmp_path / "verifiers_calc.py").write_text(TASKSET.read_text())
    (tmp_path / "config.toml").write_text(CONFIG)
    run_dir, log = run_logged(tmp_path, "rollout.max_tokens_per_turn=24", steps=3)
    checked, calls = check_token_exact(run_dir, log)
    print(f"{checked} samples, {calls} engine calls: token-exact, one version per episode")
    assert checked >= 8, f"only {checked} unmasked samples to check"
    steps = step_metrics(run_dir)
    assert all("reward/correct" in m and "reward/used_tool" in m for m in steps if "loss" in m)


@pytest.mark.parametrize("kind", ["tool", "multi"])
def test_verifiers_tool_env_trains_token_exact_on_one_version(tmp_path: Path, kind: str) -> None:
    """`tool`: the `vf.ToolEnv`; `multi`: its `vf.MultiTurnEnv` sibling, whose user answers a
    wrong reply, so that episodes of several engine calls are checked even when the tiny model
    never calls the tool."""
    (tmp_path / "verifiers_calc_env.py").write_text(ENVIRONMENT.read_text())
    (tmp_path / "config.toml").write_text(CLASSIC_CONFIG.replace("KIND", kind))
    run_dir, log = run_logged(tmp_path, "rollout.max_tokens_per_turn=24", steps=3)
    checked, calls = check_token_exact(run_dir, log)
    print(f"{kind}: {checked} samples, {calls} engine calls: token-exact, one version per episode")
    assert checked >= 8, f"only {checked} unmasked samples to check"
    if kind == "multi":
        assert calls > checked, "no episode of several calls was checked"
    steps = step_metrics(run_dir)
    assert all("reward/correct" in m and "reward/used_tool" in m for m in steps if "loss" in m)
