"""Run directories written the way `dora serve` and `dora learn` write them (their record
structs, `dora.records`), with known numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from dora.records import (
    Eval,
    InstanceTick,
    LinkCounts,
    Record,
    RolloutReport,
    Step,
    Tick,
    Trained,
    TrainerStep,
    WeightLoad,
    write_summary,
    write_trainer_step,
)


def write_run(
    run_dir: Path,
    *,
    mode: str,
    steps: int,
    step_s: float,
    tokens: float,
    wait_s: float,
    train_s: float,
    staleness: int = 0,
    util: float = 0.5,
    instances: int = 2,
    inflight: tuple[int, ...] | None = None,
    finished: bool = True,
    partial_last_line: bool = False,
    evals: bool = False,
) -> Path:
    """A run whose step t is trained at `1 + t * step_s` seconds, each with `tokens` tokens.

    Instance i loads version t at `0.9 + t * step_s` (0.1 s), and ticks every 0.5 s report `util`
    and `inflight[i]` calls in flight (1 each by default).
    """
    calls = inflight or (1,) * instances
    run_dir.mkdir(parents=True, exist_ok=True)
    records: list[Record] = []
    end = 1 + (steps - 1) * step_s
    cumulative = 0
    t = 0.5
    while t <= end:
        cumulative += 10
        records.append(_tick(t, [(f"i{i}", calls[i], util, cumulative) for i in range(instances)]))
        t += 0.5
    learn: list[TrainerStep] = []
    for s in range(steps):
        metrics = {
            "reward_mean": 0.1 + 0.01 * s,
            "tokens": tokens,
            "step_time_s": step_s,
            "wait_s": wait_s,
            "train_s": train_s,
            "staleness_mean": float(min(s, staleness)),
        }
        at = 1 + s * step_s
        versions = [max(0, s - staleness)] * 2
        records.append(
            Step(
                time_s=at - 0.2,
                step=s,
                groups=[f"g{s}-{k}" for k in range(len(versions))],
                versions=versions,
                staleness=[s - v for v in versions],
                fill_s=step_s,
            )
        )
        records.append(Trained(time_s=at, step=s, metrics=metrics))
        for i in range(instances):
            records.append(
                WeightLoad(time_s=at + 0.1, instance=f"i{i}", version=s + 1, seconds=0.1)
            )
        learn.append(TrainerStep(step=s, time=1e9 + at, metrics=metrics))
        if evals:
            records.append(eval_record(at + 0.3, step=s, accuracy=0.2 + 0.1 * s))
    records.sort(key=lambda r: r.time_s)
    hist = [0] * (staleness + 1)
    for r in records:
        if isinstance(r, Step):
            for x in r.staleness:
                hist[x] += 1
    summary = summary_record(
        time_s=end + 0.5,
        mode=mode,
        steps=steps,
        groups_sent=2 * steps,
        wall_s=end + 0.5,
        max_versions_serving=1 + staleness,
        utilisation={f"i{i}": util for i in range(instances)},
        staleness_histogram=hist,
        weight_loads=instances * steps,
        weight_load_s=0.1 * instances * steps,
        steps_trained=steps,
    )
    lines = [msgspec.json.encode(r) for r in records]
    if finished:
        lines.append(msgspec.json.encode(summary))
        write_summary(run_dir / "summary.json", summary)
    text = b"\n".join(lines) + b"\n"
    if partial_last_line:
        text += b'{"kind": "tick", "time_s": 99, "instan'
    (run_dir / "rollout.jsonl").write_bytes(text)
    for m in learn:
        write_trainer_step(run_dir / "learn-metrics.jsonl", m)
    return run_dir


def _tick(time_s: float, instances: list[tuple[str, int, float, int]]) -> Tick:
    """A `tick` at `time_s`: (id, calls in flight, utilisation, tokens so far) per instance."""
    return Tick(
        time_s=time_s,
        step=0,
        trained=-1,
        newest=0,
        published=0,
        instances=[
            InstanceTick(
                id=name,
                version=0,
                ready=True,
                draining=False,
                leases=1,
                capacity=8,
                inflight=inflight,
                util=util,
                tokens=tokens,
            )
            for name, inflight, util, tokens in instances
        ],
        live_per_version={},
        serving_versions={},
        episodes_per_version={},
        queue_per_version={},
        staleness_histogram=[],
        admitted=0,
        completed=0,
        assigned=0,
        masked=0,
        retried=0,
        rolled_back=0,
        migrations=0,
        kv_migrations=0,
        resubmissions=0,
        parks=0,
        missed_interrupts=0,
        failed_calls=0,
        instances_failed=[],
        weight_loads=0,
        weight_load_s=0.0,
        weights_held=[],
        admission_wait_s={},
        trainer_wait_s=0.0,
        loop_lag_ms=0.0,
        core_s=0.0,
        core_calls=0,
        journal_writes=0,
        journal_bytes=0,
        link=LinkCounts(),
    )


def eval_record(time_s: float, *, step: int, accuracy: float) -> Eval:
    """An `eval` of version `step` at `time_s`, finished 0.2 s after it started."""
    return Eval(
        time_s=time_s,
        step=step,
        version=step,
        due=step,
        due_s=None,
        accuracy=accuracy,
        reward_mean=0.2,
        n=8,
        masked=0,
        concurrency=8,
        version_time_s=None,
        started_s=time_s - 0.2,
        seconds=0.2,
    )


def summary_record(**fields: Any) -> RolloutReport:
    """A `summary` of a run that moved, failed and waited for nothing, but for `fields`."""
    zero: dict[str, Any] = dict.fromkeys(
        ("steps", "groups_sent", "max_versions_serving", "migrations", "kv_migrations"), 0
    )
    zero |= dict.fromkeys(("resubmissions", "parks", "missed_interrupts", "failed_calls"), 0)
    zero |= dict.fromkeys(("weight_loads", "steps_trained"), 0)
    zero |= dict.fromkeys(("wall_s", "weight_load_s", "trainer_wait_s", "max_loop_lag_ms"), 0.0)
    zero |= {"utilisation": {}, "staleness_histogram": [], "instances_failed": []}
    return RolloutReport(**{"mode": "dora", "admission_wait_s": {}, **zero, **fields})
