"""The agent loop of docs/environments.md ("Your own agent loop"), saved as a user would save it,
trained by `dora run` on the tiny model for a few steps. Checked against the engine's own record
of every request (`DORA_ENGINE_REQUEST_LOG`): the ids trained on are, call for call, what the
engine was prompted with and sampled (no re-tokenisation), with mask 1 exactly on the sampled
ones, and every call of an episode ran on its group's one version."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.env.exact import TINY_RUN, check_token_exact, run_logged, step_metrics

pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "environments.md"

pytestmark = pytest.mark.timeout(300)

CONFIG = (
    TINY_RUN
    + """
[env]
cls = "calc:solve"

[data]
source = "calc:tasks"
"""
)


def doc_agent() -> str:
    block = re.search(r"<!-- openai agent:.*?-->\n```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert block is not None
    return block.group(1)


def test_openai_agent_from_the_docs_trains_token_exact_on_one_version(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text(doc_agent())
    (tmp_path / "config.toml").write_text(CONFIG)
    run_dir, log = run_logged(tmp_path, steps=3)
    checked, turns = check_token_exact(run_dir, log)
    print(f"{checked} samples, {turns} engine calls: token-exact, one version per episode")
    assert checked >= 8, f"only {checked} unmasked samples to check"
    assert turns > checked, "no episode took more than one call"
    steps = step_metrics(run_dir)
    edits = [m["history_edits"] for m in steps if "history_edits" in m]
    assert edits and not any(edits)  # the loop appends to its history: nothing was edited
