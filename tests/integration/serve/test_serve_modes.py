"""`dora serve` end to end: 4 engine instances of a tiny model, a long-tailed chain-arithmetic
workload, and a toy trainer over the real ZMQ protocol, for 20 steps in every rollout mode.

Checked in every mode: every group arrives exactly once and every step gets exactly B groups;
`0 <= t - w <= K`; utilisation is reported per instance (summary and JSONL ticks). Per mode:
- dora: every sampled token came from the group's version (per-token versions the engines
  reported); at some moment at least two versions were serving calls; requests migrated, with the
  KV cache (on) or by resubmitting the tokens so far (off);
- sync: every group of step t was sampled by version t;
- one_step_off: one version serving at a time;
- partial: per-token versions recorded; some trajectories span versions, never going backwards
  and never older than the version the group was admitted at (which its deadline counts from);
- inflight: the same, with no request parked, resubmitted or migrated (the instances load under
  their running requests).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import on_free_port, serve_in_process
from serve_trainer import ToyTrainer

from dora.config import load_config
from dora.protocol import Group
from dora.serve.rollout import RolloutReport

STEPS, B, G, INSTANCES = 20, 2, 4, 4

pytestmark = pytest.mark.timeout(240)


def _config(mode: str, run_dir: Path, model: Path, **extra: object) -> object:
    overrides = [
        f"model.path={json.dumps(str(model))}",
        "model.max_model_len=512",
        f"serve.instances={INSTANCES}",
        "serve.max_running=8",
        "serve.request_timeout_s=120",
        "serve.weight_load_timeout_s=60",
        f"rollout.mode={mode}",
        "rollout.staleness=2",
        f"rollout.group_size={G}",
        f"rollout.batch_size={B}",
        "rollout.max_tokens=40",
        "rollout.max_turns=1",
        f"learn.steps={STEPS}",
        "env.cls=envs.math:ChainArithmeticEnv",
        f"data.source={json.dumps(str(_tasks_file(run_dir.parent)))}",
        "data.kwargs={}",
        f"log.run_dir={json.dumps(str(run_dir))}",
        "log.metrics_every_s=0.25",
        "log.progress=false",
        *(
            f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower()}"
            for k, v in extra.items()
        ),
    ]
    return load_config(None, overrides)


def _tasks_file(folder: Path) -> Path:
    """Chain-arithmetic tasks with up to 12 terms (prompt lengths long-tailed too), as JSONL."""
    path = folder / "chain.jsonl"
    if not path.exists():
        from envs.math import chain_arithmetic_tasks

        rows = [
            {"id": t.prompt_id, "question": t["question"], "gold": t["gold"]}
            for t in chain_arithmetic_tasks(200, seed=0, max_terms=12)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def _run(
    mode: str, tmp_path: Path, model: Path, **extra: object
) -> tuple[RolloutReport, ToyTrainer, list[dict[str, object]]]:
    config = _config(mode, tmp_path / mode, model, **extra)
    config, address = on_free_port(config)
    trainer = ToyTrainer(address, model_dir=model, steps=STEPS, batch_size=B)
    trainer.start()
    report = await asyncio.wait_for(
        serve_in_process(config, run_dir=tmp_path / mode, progress=False),
        200,
    )
    await asyncio.to_thread(trainer.join)
    records = [json.loads(x) for x in (tmp_path / mode / "rollout.jsonl").read_text().splitlines()]
    assert isinstance(report, RolloutReport)
    return report, trainer, records


def _sampled_versions(group: Group) -> list[np.ndarray]:
    return [s.token_versions()[s.mask() == 1] for s in group.samples]


def _common(report: RolloutReport, trainer: ToyTrainer, records: list[dict[str, object]], k: int):
    ids = [g.id for _, g in trainer.received]
    assert len(ids) == STEPS * B and len(set(ids)) == len(ids), "every group exactly once"
    assert sorted(trainer.by_step) == list(range(STEPS))
    assert all(len(gs) == B for gs in trainer.by_step.values())
    assert trainer.trained == list(range(STEPS)) and trainer.shutdown
    for step, group in trainer.received:
        assert 0 <= step - group.version <= k, (group.id, step, group.version)
        assert len(group.samples) == G
        assert all(len(v) > 0 for v in _sampled_versions(group)), "every sample sampled tokens"
    assert report.steps == STEPS and report.groups_sent == STEPS * B
    assert sum(report.staleness_histogram) == STEPS * B
    assert set(report.utilisation) == {f"i{i}" for i in range(INSTANCES)}
    assert all(0 < u <= 1 for u in report.utilisation.values()), report.utilisation
    ticks = [r for r in records if r["kind"] == "tick"]
    assert ticks and all(len(t["instances"]) == INSTANCES for t in ticks)
    assert all("util" in i for t in ticks for i in t["instances"])
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(STEPS))
    assert records[-1]["kind"] == "summary"


def _one_version_per_sample(trainer: ToyTrainer) -> None:
    for _, group in trainer.received:
        for versions in _sampled_versions(group):
            assert (versions == group.version).all(), (group.id, group.version, set(versions))


@pytest.mark.parametrize("kv_migration", [True, False], ids=["kv", "resubmit"])
async def test_dora_mode(tmp_path: Path, long_tail_model: Path, kv_migration: bool) -> None:
    # One group per instance: the newest version needs room, so old versions are consolidated
    # (with room to spare, the orchestrator leaves them alone).
    extra = {"serve.kv_migration": kv_migration, "serve.max_running": G}
    report, trainer, records = await _run("dora", tmp_path, long_tail_model, **extra)
    _common(report, trainer, records, k=2)
    _one_version_per_sample(trainer)
    loads = [r for r in records if r["kind"] == "weight_load"]
    assert loads and not [r for r in loads if r.get("under_calls")], "dora never loads under calls"
    assert report.max_versions_serving >= 2, report
    assert report.migrations > 0, report
    if kv_migration:
        assert report.kv_migrations > 0, report
    else:
        assert report.kv_migrations == 0 and report.resubmissions > 0, report


async def test_sync_mode(tmp_path: Path, long_tail_model: Path) -> None:
    report, trainer, records = await _run("sync", tmp_path, long_tail_model)
    _common(report, trainer, records, k=0)
    _one_version_per_sample(trainer)
    for step, group in trainer.received:
        assert group.version == step
    assert report.max_versions_serving == 1


async def test_one_step_off_mode(tmp_path: Path, long_tail_model: Path) -> None:
    report, trainer, records = await _run("one_step_off", tmp_path, long_tail_model)
    _common(report, trainer, records, k=1)
    _one_version_per_sample(trainer)
    assert report.max_versions_serving == 1, report
    assert report.staleness_histogram[1] > 0, "generation overlapped training"


async def test_partial_mode(tmp_path: Path, long_tail_model: Path) -> None:
    report, trainer, records = await _run("partial", tmp_path, long_tail_model)
    _common(report, trainer, records, k=2)
    spanning = 0
    for _, group in trainer.received:
        for versions in _sampled_versions(group):
            # The group is charged to the version it was admitted at (its deadline counts from
            # there); a sample parked before its first token starts on a newer one.
            assert versions[0] >= group.version
            assert (np.diff(versions) >= 0).all(), "versions never go backwards"
            spanning += len(set(versions.tolist())) > 1
    assert spanning > 0, "some trajectories continued on a newer version"
    assert report.parks > 0


async def test_inflight_mode(tmp_path: Path, long_tail_model: Path) -> None:
    # held-out evaluations every 4 steps, on tasks of their own file
    (tmp_path / "eval").mkdir()
    evals: dict[str, object] = {
        "data.eval_source": str(_tasks_file(tmp_path / "eval")),
        "data.eval_kwargs": {},
        "data.eval_size": 16,
        "data.eval_every": 4,
    }
    report, trainer, records = await _run("inflight", tmp_path, long_tail_model, **evals)
    _common(report, trainer, records, k=2)
    spanning = 0
    for _, group in trainer.received:
        for versions in _sampled_versions(group):
            assert versions[0] >= group.version  # K counts from the group's (first) version
            assert (np.diff(versions) >= 0).all(), "versions never go backwards"
            spanning += len(set(versions.tolist())) > 1
    assert spanning > 0, "some trajectories went on under a newer version"
    # the weights changed under running requests: nothing was parked, aborted or resubmitted
    assert report.parks == 0 and report.resubmissions == 0 and report.migrations == 0, report
    loads = [r for r in records if r["kind"] == "weight_load"]
    assert any(r["under_calls"] > 0 for r in loads), "the records say which loads ran under calls"
    # an evaluation is of the one version its record names: no load went under it
    evaluated = [r for r in records if r["kind"] == "eval"]
    assert len(evaluated) >= 3
    assert all(r["off_version_tokens"] == 0 for r in evaluated), evaluated
