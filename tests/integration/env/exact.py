"""The check that a `dora run` of an agent's own loop trained on exactly what the engine was
prompted with and sampled: the engine's record (`DORA_ENGINE_REQUEST_LOG`) against the ids of
`samples.jsonl`, call for call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

TINY_RUN = """
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

[log]
samples_every = 1
"""
"""The tiny model, one instance, three steps, every group in samples.jsonl: the test's `[env]`
(and `[data]`) follow."""


def run_logged(folder: Path, *overrides: str, steps: int) -> tuple[Path, Path]:
    """`dora run config.toml [overrides]` in `folder` with the engines' request log on; asserts
    it trained `steps` steps. Returns (the run directory, the request log)."""
    run_dir, log = folder / "run", folder / "engine-requests.jsonl"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "DORA_ENGINE_REQUEST_LOG": str(log)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dora.cli",
            "run",
            "config.toml",
            f"log.run_dir={run_dir}",
            *overrides,
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps_trained"] == steps
    return run_dir, log


def step_metrics(run_dir: Path) -> list[dict[str, float]]:
    lines = (run_dir / "learn-metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def engine_calls(log: Path) -> dict[str, list[dict[str, list[int]]]]:
    """The engine's requests by episode (lease `group/i`), in the order of their call number."""
    calls: dict[str, list[tuple[int, dict[str, list[int]]]]] = defaultdict(list)
    for line in log.read_text().splitlines():
        request = json.loads(line)
        lease, _, n = request["request_id"].rpartition("#")
        if lease:
            calls[lease].append((int(n), request))
    return {lease: [r for _, r in sorted(rs, key=lambda x: x[0])] for lease, rs in calls.items()}


def check_token_exact(run_dir: Path, log: Path) -> tuple[int, int]:
    """Assert, for every unmasked sample trained on, that its ids are its episode's engine calls'
    prompts and sampled ids, the sampled ones (only) with mask 1, each call of its group's one
    version. Returns (samples checked, engine calls)."""
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
    return checked, turns
