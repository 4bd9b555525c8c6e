"""`dora report RUN_DIR [--out DIR]`: one self-contained HTML page of a run, finished or running.

It reads the run directory only, as typed records (`dora.records`): `rollout.jsonl` (serve's
`tick`, `step`, `trained`, `weight_load`, `eval` records), `learn-metrics.jsonl` (the trainer's
per-step metrics) and `summary.json` when the run has ended. A line that does not decode (the last
one of a file being written) is skipped, so the report works while a run is going. It draws,
with matplotlib's Agg backend, four PNGs written beside `report.html` and embedded in it as base64
data URIs (the page needs nothing else):

- `reward.png`: reward mean per step, and held-out accuracy from `eval` records (greedy, or avg@k
  at `data.eval_temperature`, on `data.eval_source`; also any `accuracy`/`eval_*` trainer
  metric); without them, with 0/1 rewards (exact match) the reward mean is the training accuracy;
- `throughput.png`: trained tokens/s per step (trainer) and generated tokens/s (instances);
- `staleness.png`: how many groups trained at each staleness `t - w`;
- `timeline.png`: instance x time, each instance coloured by the version it holds, light where it
  was idle and full where it was generating (tick utilisation), hatched while loading weights, a
  red triangle where a load landed under running calls (mode `inflight`: they went on with the
  new weights), with the trainer's steps marked. This is the picture that explains DORA: old
  versions finish their long tails on a few instances while the others already serve the newest.

The version an instance holds comes from `weight_load` records (exact: end time and duration of
each load); utilisation is per tick interval (`log.metrics_every_s`).
"""

from __future__ import annotations

import argparse
import base64
import html
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from dora.records import (
    Eval,
    RolloutReport,
    Step,
    Tick,
    Trained,
    TrainerStep,
    WeightLoad,
    read_records,
    read_summary,
    read_trainer_steps,
)

__all__ = ["RunData", "load_run", "main", "plot_accuracy_vs_time", "version_rows", "write_report"]


@dataclass(kw_only=True)
class RunData:
    """The records of one run directory, by kind."""

    run_dir: Path
    ticks: list[Tick] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    trained: list[Trained] = field(default_factory=list)
    weight_loads: list[WeightLoad] = field(default_factory=list)
    evals: list[Eval] = field(default_factory=list)
    learn: list[TrainerStep] = field(default_factory=list)
    summary: RolloutReport | None = None
    """`summary.json`, else the `summary` record of `rollout.jsonl`; None while a run goes on."""

    @property
    def finished(self) -> bool:
        return self.summary is not None

    def step_metrics(self) -> list[tuple[int, dict[str, float]]]:
        """Per trained step, (step, the trainer's metrics) (learn-metrics.jsonl, else the
        `trained` records of rollout.jsonl)."""
        if self.learn:
            return sorted(((r.step, r.metrics) for r in self.learn), key=lambda r: r[0])
        return [(r.step, r.numbers()) for r in self.trained]


def load_run(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    data = RunData(run_dir=run_dir, learn=read_trainer_steps(run_dir / "learn-metrics.jsonl"))
    for record in read_records(run_dir / "rollout.jsonl"):
        match record:
            case Tick():
                data.ticks.append(record)
            case Step():
                data.steps.append(record)
            case Trained():
                data.trained.append(record)
            case WeightLoad():
                data.weight_loads.append(record)
            case Eval():
                data.evals.append(record)
            case RolloutReport():
                data.summary = record
    data.summary = read_summary(run_dir / "summary.json") or data.summary
    return data


# --- figures -------------------------------------------------------------------------------------


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_reward(run: RunData, path: Path) -> str:
    plt = _plt()
    metrics = run.step_metrics()
    steps = [step for step, _ in metrics]
    acc_keys = sorted(
        {k for _, m in metrics for k in m if k == "accuracy" or k.startswith("eval_")}
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    axes[0].plot(steps, [m.get("reward_mean", float("nan")) for _, m in metrics], marker=".")
    axes[0].set(title="reward mean (training samples)", xlabel="step", ylabel="reward")
    note = ""
    if run.evals:
        pts = sorted((e.step, e.accuracy) for e in run.evals)
        how = eval_label(run.evals[0].temperature, run.evals[0].samples_per_task)
        axes[1].plot(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"held-out ({how})"
        )
    for k in acc_keys:
        pts = [(step, m[k]) for step, m in metrics if k in m]
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k)
    if run.evals or acc_keys:
        axes[1].legend()
        axes[1].set(title="accuracy", xlabel="step (version)", ylim=(-0.02, 1.02))
    else:
        axes[1].text(
            0.5,
            0.5,
            "no accuracy or eval records",
            ha="center",
            va="center",
            transform=axes[1].transAxes,
        )
        axes[1].set(title="accuracy", xlabel="step")
        note = (
            "No accuracy is recorded (no `eval` records: data.eval_source is empty); with 0/1 "
            "rewards the reward mean is the training accuracy."
        )
    _save(fig, path)
    return note


def eval_label(temperature: float, samples_per_task: int) -> str:
    """How held-out episodes were decoded, for a plot: "greedy" or "avg@k at T t"."""
    return "greedy" if temperature <= 0 else f"avg@{samples_per_task} at T {temperature:g}"


def plot_accuracy_vs_time(
    curves: dict[str, list[tuple[float, float]]], path: Path, *, title: str, how: str = "greedy"
) -> None:
    """Held-out accuracy against wall-clock seconds, one line per named run (several trainers
    on one workload: what each reaches by a given time); `how` the decoding (`eval_label`)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, points in curves.items():
        pts = sorted(points)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set(title=title, xlabel="seconds of training", ylabel=f"held-out accuracy ({how})")
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, path)


def plot_throughput(run: RunData, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.2))
    trained = sorted(run.trained, key=lambda r: r.time_s)
    if len(trained) >= 2:
        xs, ys = [], []
        for a, b in itertools.pairwise(trained):
            dt = b.time_s - a.time_s
            if dt > 0:
                xs.append(b.time_s)
                ys.append(b.numbers().get("tokens", 0.0) / dt)
        ax.step(xs, ys, where="pre", label="trained tokens/s (per step)")
    gen_x, gen_y = [], []
    for t0, t1 in itertools.pairwise(run.ticks):
        dt = t1.time_s - t0.time_s
        if dt > 0:
            before = sum(i.tokens for i in t0.instances)
            after = sum(i.tokens for i in t1.instances)
            gen_x.append(t1.time_s)
            gen_y.append(max(0, after - before) / dt)
    if gen_x:
        ax.plot(gen_x, gen_y, alpha=0.6, label="generated tokens/s (all instances)")
    ax.set(title="throughput", xlabel="time (s)", ylabel="tokens/s")
    if gen_x or len(trained) >= 2:
        ax.legend()
    _save(fig, path)


def staleness_histogram(run: RunData) -> list[int]:
    if run.summary is not None and run.summary.staleness_histogram:
        return list(run.summary.staleness_histogram)
    counts: dict[int, int] = {}
    for rec in run.steps:
        for s in rec.staleness:
            counts[s] = counts.get(s, 0) + 1
    return [counts.get(s, 0) for s in range(max(counts, default=-1) + 1)]


def plot_staleness(run: RunData, path: Path) -> None:
    plt = _plt()
    hist = staleness_histogram(run)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(range(len(hist)), hist, color="#4c72b0")
    ax.set(title="staleness of trained groups", xlabel="t - w (versions)", ylabel="groups")
    ax.set_xticks(range(len(hist)))
    _save(fig, path)


def version_segments(run: RunData) -> dict[str, list[tuple[float, float, int, bool]]]:
    """Per instance: (start, end, version, loading) segments, from the weight loads."""
    names = sorted({i.id for t in run.ticks for i in t.instances}) or sorted(
        {w.instance for w in run.weight_loads}
    )
    end = max(
        [r.time_s for r in (*run.ticks, *run.steps, *run.trained, *run.weight_loads)],
        default=0.0,
    )
    out: dict[str, list[tuple[float, float, int, bool]]] = {}
    for name in names:
        loads = sorted((w for w in run.weight_loads if w.instance == name), key=lambda w: w.time_s)
        segs, t, version = [], 0.0, 0
        for w in loads:
            begin = max(t, w.time_s - w.seconds)
            if begin > t:
                segs.append((t, begin, version, False))
            segs.append((begin, w.time_s, w.version, True))
            t, version = w.time_s, w.version
        if end > t:
            segs.append((t, end, version, False))
        out[name] = segs
    return out


def plot_timeline(run: RunData, path: Path) -> None:
    names = list(version_segments(run))
    fig, ax = _plt().subplots(figsize=(12, 0.6 * len(names) + 1.8))
    draw_timeline(ax, run)
    _save(fig, path)


def plot_timelines(panels: list[tuple[str, RunData]], path: Path, *, seconds: float) -> None:
    """Several runs' timelines stacked, each over `seconds` from its first trained step (the same
    scale for all), titled by the given labels: the modes of `dora bench modes` side by side."""
    rows = [len(version_segments(run)) for _, run in panels]
    fig, axes = _plt().subplots(
        len(panels),
        1,
        figsize=(12, sum(0.5 * n + 1.3 for n in rows)),
        gridspec_kw={"height_ratios": [n + 2.6 for n in rows]},
        squeeze=False,
    )
    for ax, (label, run) in zip(axes[:, 0], panels, strict=True):
        first = min((r.time_s for r in run.trained), default=0.0)
        draw_timeline(ax, run, span=(first, first + seconds), title=label)
    _save(fig, path)


def draw_timeline(
    ax: Any, run: RunData, *, span: tuple[float, float] | None = None, title: str | None = None
) -> None:
    """One row per instance on `ax`, coloured by the version it holds (`span`: seconds shown)."""
    plt = _plt()
    segments = version_segments(run)
    names = list(segments)
    versions = sorted({s[2] for segs in segments.values() for s in segs}) or [0]
    cmap = plt.get_cmap("tab10")  # neighbouring versions must differ; labels name each block

    def colour(v: int) -> Any:
        return cmap(v % 10)

    util: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    for before, b in zip([0.0, *(t.time_s for t in run.ticks)], run.ticks, strict=False):
        for inst in b.instances:
            if inst.id in util:
                util[inst.id].append((before, b.time_s, inst.util))
    for y, name in enumerate(names):
        for start, stop, v, loading in segments[name]:
            ax.broken_barh(
                [(start, stop - start)],
                (y - 0.4, 0.8),
                facecolors=colour(v),
                alpha=0.35,
                hatch="////" if loading else None,
                edgecolor="black" if loading else None,
                linewidth=0,
            )
        for start, stop, u in util[name]:  # the busy part of each interval, drawn solid
            for s0, s1, v, _ in segments[name] if u > 0 else []:
                lo, hi = max(start, s0), min(stop, s1)
                if hi > lo:
                    ax.broken_barh([(lo, hi - lo)], (y - 0.4 * u, 0.8 * u), facecolors=colour(v))
    end = max((seg[1] for segs in segments.values() for seg in segs), default=1.0)
    lo, hi = span if span is not None else (0.0, end)
    for y, name in enumerate(names):  # name the version of every block wide enough for a label
        for start, stop, v, loading in segments[name]:
            shown = min(stop, hi) - max(start, lo)
            if not loading and shown > 0.025 * (hi - lo):
                mid = (max(start, lo) + min(stop, hi)) / 2
                ax.text(mid, y, f"v{v}", ha="center", va="center", fontsize=7)
    under = [w for w in run.weight_loads if w.under_calls and w.instance in names]
    if under:  # loads under running calls: the calls went on with the new weights
        ax.scatter(
            [w.time_s for w in under],
            [names.index(w.instance) + 0.4 for w in under],
            marker="v",
            color="crimson",
            s=22,
            zorder=3,
        )
    for rec in run.trained:
        ax.axvline(rec.time_s, color="black", alpha=0.25, linewidth=0.8)
    if span is not None:
        ax.set_xlim(lo, hi)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel(
        "time (s); bar height: utilisation (pale: idle); hatched: loading; grey: a step trained"
    )
    mode = run.summary.mode if run.summary is not None else ""
    ax.set_title(title or f"{mode} instances x time, coloured by the version each holds".strip())
    from matplotlib.patches import Patch

    handles: list[Any] = [Patch(color=colour(v), label=f"v{v}") for v in versions[:10]]
    if len(versions) > 10:
        handles = [Patch(color=colour(v), label=f"v{v}, v{v + 10}, ...") for v in range(10)]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="loading"))
    if under:
        from matplotlib.lines import Line2D

        handles.append(
            Line2D([], [], marker="v", color="crimson", linestyle="", label="loaded under calls")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


# --- the page ------------------------------------------------------------------------------------

SUMMARY_KEYS = (
    "mode",
    "steps",
    "steps_trained",
    "wall_s",
    "max_versions_serving",
    "utilisation",
    "migrations",
    "kv_migrations",
    "resubmissions",
    "parks",
    "weight_loads",
    "weight_load_s",
    "admission_wait_s",
    "trainer_wait_s",
    "max_loop_lag_ms",
    "max_loop_stall_ms",
)


def version_rows(run: RunData) -> list[tuple[str, str]]:
    """How many trajectories spanned versions over the trained steps, and the mean fraction of
    tokens sampled by another version than their trajectory's first (none where the trainer's
    records lack them)."""
    steps = [m for _, m in run.step_metrics() if "trajectories_spanning_versions" in m]
    if not steps:
        return []
    spanning = sum(m["trajectories_spanning_versions"] for m in steps)
    off_first = sum(m["off_first_version_fraction"] for m in steps) / len(steps)
    return [
        ("trajectories_spanning_versions", json.dumps(round(spanning))),
        ("off_first_version_fraction", json.dumps(round(off_first, 6))),
    ]


def _summary_rows(run: RunData) -> list[tuple[str, str]]:
    if run.summary is not None:
        summary = msgspec.to_builtins(run.summary)
        return [(k, json.dumps(summary[k])) for k in SUMMARY_KEYS] + version_rows(run)
    rows = [("state", "running (no summary yet)")]
    if run.ticks:
        last = run.ticks[-1]
        rows += [(k, json.dumps(getattr(last, k))) for k in ("step", "trained", "newest")]
    return rows + version_rows(run)


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write `report.html` and its PNGs into `out` (default: the run directory)."""
    run = load_run(run_dir)
    out = Path(out) if out is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    notes = []
    images = [
        ("reward.png", "Reward and accuracy"),
        ("throughput.png", "Throughput"),
        ("staleness.png", "Staleness"),
        ("timeline.png", "Instances x time, by version"),
    ]
    note = plot_reward(run, out / "reward.png")
    if note:
        notes.append(note)
    plot_throughput(run, out / "throughput.png")
    plot_staleness(run, out / "staleness.png")
    plot_timeline(run, out / "timeline.png")
    if not run.weight_loads and run.ticks:
        notes.append("No weight_load records: every instance is drawn at version 0.")
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
        for k, v in _summary_rows(run)
    )
    figures = "".join(
        f"<h2>{html.escape(title)}</h2><img alt='{name}' src='data:image/png;base64,"
        f"{base64.b64encode((out / name).read_bytes()).decode()}'>"
        for name, title in images
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>dora report: {html.escape(str(run_dir))}</title>"
        "<style>body{font-family:sans-serif;max-width:1400px;margin:1em auto}"
        "img{max-width:100%}th{text-align:left;padding-right:1em}</style></head><body>"
        f"<h1>dora report: {html.escape(str(run_dir))}</h1><table>{rows}</table>"
        + "".join(f"<p><em>{html.escape(n)}</em></p>" for n in notes)
        + figures
        + "</body></html>"
    )
    path = out / "report.html"
    path.write_text(page)
    return path


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if (
        not (run_dir / "rollout.jsonl").is_file()
        and not (run_dir / "learn-metrics.jsonl").is_file()
    ):
        print(f"dora report: {run_dir} has no rollout.jsonl or learn-metrics.jsonl")
        return 1
    path = write_report(run_dir, Path(args.out) if args.out else None)
    print(f"dora report: wrote {path}")
    return 0
