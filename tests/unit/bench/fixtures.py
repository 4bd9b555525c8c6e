"""Run directories written the way `dora serve` and `dora learn` write them, with known numbers."""

from __future__ import annotations

import json
from pathlib import Path


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
    records: list[dict[str, object]] = []
    end = 1 + (steps - 1) * step_s
    cumulative = 0
    t = 0.5
    while t <= end:
        cumulative += 10
        records.append(
            {
                "kind": "tick",
                "time_s": t,
                "step": 0,
                "trained": -1,
                "newest": 0,
                "instances": [
                    {
                        "id": f"i{i}",
                        "version": 0,
                        "ready": True,
                        "draining": False,
                        "leases": 1,
                        "capacity": 8,
                        "inflight": calls[i],
                        "util": util,
                        "tokens": cumulative,
                    }
                    for i in range(instances)
                ],
            }
        )
        t += 0.5
    learn = []
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
            {
                "kind": "step",
                "time_s": at - 0.2,
                "step": s,
                "versions": versions,
                "staleness": [s - v for v in versions],
                "fill_s": step_s,
            }
        )
        records.append({"kind": "trained", "time_s": at, "step": s, "metrics": metrics})
        for i in range(instances):
            records.append(
                {
                    "kind": "weight_load",
                    "time_s": at + 0.1,
                    "instance": f"i{i}",
                    "version": s + 1,
                    "seconds": 0.1,
                }
            )
        learn.append({"step": s, **metrics})
        if evals:
            records.append(
                {
                    "kind": "eval",
                    "time_s": at + 0.3,
                    "step": s,
                    "version": s,
                    "accuracy": 0.2 + 0.1 * s,
                    "reward_mean": 0.2,
                    "n": 8,
                }
            )
    records.sort(key=lambda r: float(r["time_s"]))  # type: ignore[arg-type]
    hist = [0] * (staleness + 1)
    for r in records:
        if r["kind"] == "step":
            for x in r["staleness"]:  # type: ignore[attr-defined]
                hist[x] += 1
    summary = {
        "mode": mode,
        "steps": steps,
        "wall_s": end + 0.5,
        "max_versions_serving": 1 + staleness,
        "utilisation": {f"i{i}": util for i in range(instances)},
        "staleness_histogram": hist,
    }
    lines = [json.dumps(r) for r in records]
    if finished:
        lines.append(json.dumps({"kind": "summary", **summary}))
        (run_dir / "summary.json").write_text(json.dumps(summary))
    text = "\n".join(lines) + "\n"
    if partial_last_line:
        text += '{"kind": "tick", "time_s": 99, "instan'
    (run_dir / "rollout.jsonl").write_text(text)
    (run_dir / "learn-metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in learn))
    return run_dir
