"""`dora bench converge CONFIG`: the rollout modes head to head on what they learn, not only on
how fast they sample.

Each (mode, staleness K, seed) is a real `dora run` of the config to the same number of steps,
with everything else equal (model, tasks, warm-up, learning rate, off-policy correction): only
`rollout.mode`, `rollout.staleness` and the seeds (`model.seed`, `learn.seed`, `data.seed`)
change. `sync` has K = 0 whatever `--staleness` says, so it runs once per seed and stands in every
K's table. The config must evaluate while training (`data.eval_source`, `data.eval_every`).

For each K the command prints one row per mode, over the seeds (mean, and min-max): steps/s and
trained tokens/s, the warm-up's and the final held-out accuracy, the seconds to reach `--target`
(the first evaluation at or above it; `-` where a run never did) and to stand `--gain` above the
run's own warm-up, and the off-policy diagnostics averaged over the run's steps (importance-weight
ESS, the fraction of tokens whose ratio was capped or masked, the fraction of tokens sampled by a
version other than their trajectory's first). It writes `converge.json` (every run's curve and
numbers) and `converge.png` (held-out accuracy against steps and against seconds, one line per
mode, the seeds' range shaded) into `--out`.

A sweep takes hours; run again with the same `--out`, a run of the same config and overrides that
ended well is read, not run again (its folder holds
`converge-run.json`), and one cut short, or of other settings, is run again from the start, so a
sweep that was stopped goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dora.bench import dora_run, summary
from dora.config import load_config
from dora.records import Eval, Trained, read_records

__all__ = ["RunResult", "finished", "main", "read_run", "table", "target_seconds"]

DIAGNOSTICS = ("is_ess", "is_capped_fraction", "off_first_version_fraction")


@dataclass
class RunResult:
    """One run's learning curve and throughput, read from its run directory."""

    mode: str
    staleness: int
    seed: int
    steps: int
    seconds: float
    """From the start of serve's rollout to the last trained step."""
    tokens: float
    curve: list[tuple[int, float, float]] = field(default_factory=list)
    """(version, seconds at which that version was published, held-out accuracy)."""
    diagnostics: dict[str, float] = field(default_factory=dict)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def final_accuracy(self) -> float:
        return self.curve[-1][2] if self.curve else math.nan


def read_run(run_dir: Path, *, mode: str, staleness: int, seed: int) -> RunResult:
    """The curve of a finished run: version w is published when step w - 1 is trained (version 0
    at time 0), and each evaluation of version w is placed there."""
    records = read_records(run_dir / "rollout.jsonl", kinds={"trained", "eval"})
    trained = sorted((r for r in records if isinstance(r, Trained)), key=lambda r: r.step)
    at = {r.step: r.time_s for r in trained}
    curve = sorted(
        (r.version, at.get(r.version - 1, 0.0), r.accuracy) for r in records if isinstance(r, Eval)
    )
    diagnostics: dict[str, float] = {}
    for name in DIAGNOSTICS:
        values = [v for r in trained if math.isfinite(v := r.numbers().get(name, math.nan))]
        if values:
            diagnostics[name] = statistics.fmean(values)
    return RunResult(
        mode=mode,
        staleness=staleness,
        seed=seed,
        steps=len(trained),
        seconds=trained[-1].time_s if trained else 0.0,
        tokens=sum(r.numbers().get("tokens", 0.0) for r in trained),
        curve=[(int(v), float(s), float(a)) for v, s, a in curve],
        diagnostics=diagnostics,
    )


DONE_FILE = "converge-run.json"
"""Written into a run's folder when its `dora run` succeeded: the config and overrides it ran."""


def finished(run_dir: Path, command: list[str]) -> bool:
    """Whether `run_dir` holds a run of `command` (config, then overrides) that ended well: one a
    sweep run again can reuse. A run of other settings, or one cut short, is not."""
    done = run_dir / DONE_FILE
    return done.is_file() and json.loads(done.read_text()) == command


def target_seconds(run: RunResult, target: float) -> float | None:
    """When the run's held-out accuracy first reached `target` (None: never)."""
    return next((s for _, s, a in run.curve if a >= target), None)


def gain_seconds(run: RunResult, gain: float) -> float | None:
    """When the run's held-out accuracy first stood `gain` above its own warm-up's (version 0;
    None: never, or version 0 was not evaluated). Seeds whose warm-ups differ are timed alike,
    where one absolute target is met at once by a seed that starts above it."""
    if not run.curve or run.curve[0][0] != 0:
        return None
    return target_seconds(run, run.curve[0][2] + gain - 1e-9)


def default_target(runs: Sequence[RunResult]) -> float:
    """Halfway from the mean warm-up accuracy (version 0) to the best mean final accuracy of a
    mode: a level some runs reach and the comparison can time."""
    starts = [r.curve[0][2] for r in runs if r.curve and r.curve[0][0] == 0]
    finals: dict[str, list[float]] = {}
    for r in runs:
        if r.curve:
            finals.setdefault(r.mode, []).append(r.final_accuracy)
    if not starts or not finals:
        return math.nan
    best = max(statistics.fmean(v) for v in finals.values())
    return round(statistics.fmean(starts) + (best - statistics.fmean(starts)) / 2, 3)


def _spread(values: Sequence[float | None], fmt: str) -> str:
    got = [v for v in values if v is not None and math.isfinite(v)]
    if not got:
        return "-"
    text = format(statistics.fmean(got), fmt)
    if len(got) > 1:
        text += f" ({format(min(got), fmt)}-{format(max(got), fmt)})"
    if len(got) < len(values):
        text += f" [{len(got)}/{len(values)}]"
    return text


def table(
    runs: Sequence[RunResult], *, staleness: int, target: float, gain: float = 0.05
) -> list[str]:
    """The rows of one K's table: each mode over its seeds (sync's K = 0 runs stand in)."""
    head = f"K = {staleness}, target accuracy {target:.3f}: mean (min-max) over seeds"
    cols = (
        "mode",
        "steps/s",
        "tokens/s",
        "warm-up acc",
        "final acc",
        "s to target",
        f"s to +{gain:g}",
        "ESS",
        "capped",
        "off-first",
    )
    rows: list[tuple[str, ...]] = [cols]
    for mode in dict.fromkeys(r.mode for r in runs):
        of = [r for r in runs if r.mode == mode and (r.staleness == staleness or mode == "sync")]
        if not of:
            continue
        rows.append(
            (
                f"{mode} ({len(of)} seeds)",
                _spread([r.steps_per_s for r in of], ".2f"),
                _spread([r.tokens_per_s for r in of], ",.0f"),
                _spread([r.curve[0][2] if r.curve else None for r in of], ".3f"),
                _spread([r.final_accuracy for r in of], ".3f"),
                _spread([target_seconds(r, target) for r in of], ".0f"),
                _spread([gain_seconds(r, gain) for r in of], ".0f"),
                *(_spread([r.diagnostics.get(d) for r in of], ".3f") for d in DIAGNOSTICS),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = [head]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return lines


def plot(runs: Sequence[RunResult], staleness: Sequence[int], path: Path, *, title: str) -> None:
    """Held-out accuracy against steps and against seconds, a row of two panels per K: each
    mode's mean over its seeds, the seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(staleness), 2, figsize=(11, 3.4 * len(staleness)), squeeze=False)
    for row, k in zip(axes, staleness, strict=True):
        for mode in dict.fromkeys(r.mode for r in runs):
            of = [r for r in runs if r.mode == mode and (r.staleness == k or mode == "sync")]
            versions = sorted({v for r in of for v, _, _ in r.curve})
            for ax, x_of in ((row[0], "steps"), (row[1], "seconds")):
                xs, mean, lo, hi = [], [], [], []
                for v in versions:
                    points = [(s, a) for r in of for w, s, a in r.curve if w == v]
                    if len(points) < len(of):
                        continue  # a version some seeds did not evaluate
                    acc = [a for _, a in points]
                    xs.append(v if x_of == "steps" else statistics.fmean(s for s, _ in points))
                    mean.append(statistics.fmean(acc))
                    lo.append(min(acc))
                    hi.append(max(acc))
                (line,) = ax.plot(xs, mean, marker="o", label=mode)
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
        row[0].set(title=f"{title}, K = {k}", xlabel="step", ylabel="held-out accuracy")
        row[1].set(title=f"{title}, K = {k}", xlabel="seconds of training")
        for ax in row:
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan(modes: Sequence[str], staleness: Sequence[int], seeds: int) -> list[tuple[str, int, int]]:
    """The runs, (mode, K, seed), seed by seed so that a sweep cut short has every mode: sync
    once per seed (K = 0), the other modes once per K."""
    out: list[tuple[str, int, int]] = []
    for seed in range(seeds):
        for mode in modes:
            for k in [0] if mode == "sync" else staleness:
                out.append((mode, k, seed))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dora bench converge", description=summary(__doc__))
    p.add_argument("config", help="config file that evaluates while training")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--modes", default="sync,dora,inflight", help="comma-separated rollout modes")
    p.add_argument("--staleness", default="1,3", help="comma-separated K for the async modes")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of model, learn and data")
    p.add_argument("--steps", type=int, default=None, help="learn.steps (default: the config's)")
    p.add_argument("--target", type=float, default=None, help="accuracy to time (default: auto)")
    p.add_argument("--gain", type=float, default=0.05, help="rise over each run's warm-up to time")
    p.add_argument("--out", default=None, help="output folder (default runs/converge-<time>)")
    p.add_argument("--title", default="", help="the plot's title (default: the config's folder)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    ks = sorted({int(k) for k in args.staleness.split(",") if k.strip()})
    overrides = list(args.overrides) + ([f"learn.steps={args.steps}"] if args.steps else [])
    config = load_config(args.config, [*overrides, f"rollout.mode={modes[0]}"])
    if not config.data.eval_source:
        raise SystemExit("dora bench converge: the config does not evaluate (data.eval_source)")
    out = Path(args.out or f"runs/converge-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    runs: list[RunResult] = []
    todo = plan(modes, ks, args.seeds)
    for i, (mode, k, seed) in enumerate(todo, 1):
        name = f"{mode}-k{k}-s{seed}"
        print(f"dora bench converge: run {i}/{len(todo)}: {name}", flush=True)
        seeds = [f"model.seed={seed}", f"learn.seed={seed}", f"data.seed={seed}"]
        mode_keys = [f"rollout.mode={mode}"] + (
            [] if mode == "sync" else [f"rollout.staleness={k}"]
        )
        run_dir = out / name
        log = out / f"{name}.log"
        command = [args.config, *overrides, *mode_keys, *seeds]
        if finished(run_dir, command):
            print(f"dora bench converge: {name} finished before, read from {run_dir}", flush=True)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)  # cut short, or other settings: again
            if dora_run(args.config, command[1:], run_dir, log):
                raise SystemExit(f"dora bench converge: {name} failed; see {log}")
            (run_dir / DONE_FILE).write_text(json.dumps(command) + "\n")
        runs.append(read_run(run_dir, mode=mode, staleness=k, seed=seed))
    target = args.target if args.target is not None else default_target(runs)
    doc: dict[str, Any] = {"config": args.config, "overrides": overrides, "target": target}
    doc["runs"] = [asdict(r) for r in runs]
    (out / "converge.json").write_text(json.dumps(doc, indent=1) + "\n")
    for k in ks:
        print("\n".join(table(runs, staleness=k, target=target, gain=args.gain)))
    plot(runs, ks, out / "converge.png", title=args.title or Path(args.config).parent.name)
    print(f"held-out accuracy against steps and seconds: {out / 'converge.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
