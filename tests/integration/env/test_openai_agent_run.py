"""The agent loop of docs/environments.md ("Your own agent loop"), saved as a user would save it,
trained by `dora run` on the tiny model for a few steps. Checked against the engine's own record
of every request (`DORA_ENGINE_REQUEST_LOG`): the ids trained on are, call for call, what the
engine was prompted with and sampled (no re-tokenisation), with mask 1 exactly on the sampled
ones, and every call of an episode ran on its group's one version."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "environments.md"

pytestmark = pytest.mark.timeout(300)

CONFIG = """
[model]
path = "tiny"
max_model_len = 1024

[serve]
instances = 1

[rollout]
group_size = 4
batch_size = 2
max_tokens = 72
max_turns = 4

[learn]
steps = 3
lr = 1e-5
checkpoint_every = 3

[env]
cls = "calc:solve"

[data]
source = "calc:tasks"

[log]
name = "calc"
samples_every = 1
"""


def doc_agent() -> str:
    block = re.search(r"<!-- openai agent:.*?-->\n```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert block is not None
    return block.group(1)


def engine_calls(log: Path) -> dict[str, list[dict[str, list[int]]]]:
    """The engine's requests by episode (lease `group/i`), in the order of their call number."""
    calls: dict[str, list[tuple[int, dict[str, list[int]]]]] = defaultdict(list)
    for line in log.read_text().splitlines():
        request = json.loads(line)
        lease, _, n = request["request_id"].rpartition("#")
        if lease:
            calls[lease].append((int(n), request))
    return {lease: [r for _, r in sorted(rs, key=lambda x: x[0])] for lease, rs in calls.items()}


def test_openai_agent_from_the_docs_trains_token_exact_on_one_version(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text(doc_agent())
    (tmp_path / "config.toml").write_text(CONFIG)
    run_dir, log = tmp_path / "run", tmp_path / "engine-requests.jsonl"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "DORA_ENGINE_REQUEST_LOG": str(log)}
    proc = subprocess.run(
        [sys.executable, "-m", "dora.cli", "run", "config.toml", f"log.run_dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps_trained"] == 3
    calls = engine_calls(log)
    groups = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    checked = turns = 0
    for group in groups:
        for i, sample in enumerate(group["samples"]):
            if sample["masked"]:
                continue
            episode = calls[f"{group['group']}/{i}"]
            tokens, mask = sample["token_ids"], sample["loss_mask"]
            assert tokens == episode[-1]["prompt_ids"] + episode[-1]["token_ids"]
            expected = [0] * len(tokens)
            for request in episode:
                prompt, sampled = request["prompt_ids"], request["token_ids"]
                assert tokens[: len(prompt)] == prompt
                assert tokens[len(prompt) : len(prompt) + len(sampled)] == sampled
                expected[len(prompt) : len(prompt) + len(sampled)] = [1] * len(sampled)
                assert set(request["versions"]) <= {group["version"]}
            assert mask == expected
            checked += 1
            turns += len(episode)
    print(f"{checked} samples, {turns} engine calls: token-exact, one version per episode")
    assert checked >= 8, f"only {checked} unmasked samples to check"
    assert turns > checked, "no episode took more than one call"
    steps = [json.loads(x) for x in (run_dir / "learn-metrics.jsonl").read_text().splitlines()]
    edits = [m["history_edits"] for m in steps if "history_edits" in m]
    assert edits and not any(edits)  # the loop appends to its history: nothing was edited
