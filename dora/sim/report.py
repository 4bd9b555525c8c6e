"""What a simulated run measured, as numbers, tables, JSON and a timeline picture.

Averages cover the steps after warm-up (`warmup_steps`), as the paper averages iterations after
warm-up: the window runs from the end of the last warm-up step to the end of the last step.

- tokens/s counts prompt and response tokens of the consumed groups (the paper's definition);
- rollout-only share: time the trainer is idle while some instance generates (for colocated
  modes, the rollout phase; for disaggregated ones, the generation that training does not hide);
- instance utilisation: share of instance-time spent decoding or prefilling; slot use: running
  sequences over `max_seqs`;
- the physical bound per step: disaggregated `max(train time, generation work / capacity)`,
  colocated `train time + generation work / capacity + weight sync` (the GPUs cannot overlap the
  two). Capacity is an instance's decode throughput when its KV cache is full of sequences of the
  workload's average running context. Efficiency = bound / achieved step time.
- the tight bound per step: the larger of the physical bound and the chain bound, which counts
  each episode's turns and tool waits in order (docs/simulator.md, "A bound for chains of
  turns"); efficiency vs tight bound = tight bound / achieved step time.
"""

from __future__ import annotations

import dataclasses
import io
import sys
from collections import Counter
from typing import Any

from dora.costs import Setup
from dora.sim.events import Run
from dora.sim.workload import mean_stats

__all__ = ["PAPER", "render", "summarize", "write_plot"]

PAPER: dict[str, dict[str, dict[str, float]]] = {
    "paper-64": {
        "sync": {"step_min": 22.91, "tokens_per_s": 14143, "rollout_only": 0.65},
        "one_step_off": {"step_min": 22.94, "tokens_per_s": 14141, "rollout_only": 0.33},
        "partial": {"step_min": 17.38, "tokens_per_s": 19872, "rollout_only": 0.46},
        "dora": {"step_min": 14.67, "tokens_per_s": 23327, "rollout_only": 0.12},
    },
    "paper-128": {
        "sync": {"step_min": 20.23, "tokens_per_s": 16070, "rollout_only": 0.73},
        # the paper gives one-off and partial at 128 GPUs only as dora's speedups over them
        "one_step_off": {"step_min": 10.46 * 1.34, "tokens_per_s": 34135 / 1.47},
        "partial": {"step_min": 13.95, "tokens_per_s": 34135 / 1.11},
        "dora": {"step_min": 10.46, "tokens_per_s": 34135, "rollout_only": 0.24},
    },
}
"""The paper's Table (§5.2, Figs. 8-10): step time, end-to-end tokens/s, rollout-only share."""


def bound_s(setup: Setup, run: Run, tokens_per_step: float) -> tuple[float, float, float]:
    """`(bound, train time, generation time)` per step for this mode's placement."""
    s, plan = setup, run.plan
    tokens_mean, decoded_mean, ctx_mean = mean_stats(s)
    t0, c, k = s.decode_coefficients()
    b = max(1.0, min(float(s.max_seqs), s.kv_capacity_tokens / max(ctx_mean, 1.0)))
    tps = b / (t0 + c * b + k * b * ctx_mean)
    decoded = tokens_per_step * decoded_mean / tokens_mean
    gen = decoded / (plan.instances * tps)
    train = s.train_s(tokens_per_step, plan.train_gpus) + s.train_step_overhead_s
    if plan.colocated:
        return train + gen + s.weight_sync_s, train, gen
    return max(train, gen), train, gen


def chain_bound_s(run: Run) -> float:
    """The chain bound per step over the measured steps (docs/simulator.md, "A bound for chains
    of turns"): the earliest the last step could end, given when the window began, over the
    number of measured steps."""
    w, n = run.setup.warmup_steps, len(run.step_end_s)
    if n <= w:
        return 0.0
    earliest, _ = _earliest_ends(run)
    start = run.step_end_s[w - 1] if w >= 1 else 0.0
    return (earliest[-1] - start) / (n - w)


def chain_bound_path(run: Run) -> str:
    """What the chain bound waits for, from the window's last step back to a step before it:
    `chain i` where step i waits for its longest chain (started once step i - K - 1 published
    its version), `train i` where it waits for the trainer to finish step i - 1 (`train i..j`
    for steps i down to j in a row)."""
    w, n = run.setup.warmup_steps, len(run.step_end_s)
    if n <= w:
        return ""
    _, via = _earliest_ends(run)
    parts: list[str] = []
    i = n - 1
    while i >= w:
        src, kind = via[i - w]
        if kind == "train" and parts and parts[-1].startswith("train"):
            parts[-1] = f"{parts[-1].split('..')[0]}..{i}"
        else:
            parts.append(f"{kind} {i}")
        i = src
    parts.append("time 0" if i < 0 else f"end of step {i}")
    return " <- ".join(parts)


def _earliest_ends(run: Run) -> tuple[list[float], list[tuple[int, str]]]:
    """The earliest end of every measured step, and which of its predecessors set it. Step i
    ends no earlier than the trainer allows (step i - 1's end, then step i's training and
    overhead), nor than its longest least-time chain allows: started once step i - K - 1
    published its version and an instance loaded it, followed by the training that must come
    after the step's last group. Steps before the window enter with their measured ends (time
    0 before the first)."""
    s, plan = run.setup, run.plan
    k, w, ends = plan.staleness, s.warmup_steps, run.step_end_s
    earliest: list[float] = []
    via: list[tuple[int, str]] = []

    def end(j: int) -> float:
        return earliest[j - w] if j >= w else ends[j] if j >= 0 else 0.0

    for i in range(w, len(ends)):
        src = max(-1, i - k - 1)
        load = s.weight_sync_s if src >= 0 else 0.0
        chain = end(src) + load + run.step_chain_s[i] + _train_after_last_group(run, i)
        train = end(i - 1) + s.train_s(run.step_tokens[i], plan.train_gpus)
        train += s.train_step_overhead_s
        earliest.append(max(chain, train))
        via.append((src, "chain") if chain >= train else (i - 1, "train"))
    return earliest, via


def _train_after_last_group(run: Run, step: int) -> float:
    """What the trainer must still do once the last group of `step` arrived: the step's
    overhead, and its whole training unless it streams groups into the step as they arrive."""
    s, plan = run.setup, run.plan
    if plan.colocated or not s.stream_training:
        return s.train_s(run.step_tokens[step], plan.train_gpus) + s.train_step_overhead_s
    return s.train_step_overhead_s


def longest_chains(run: Run) -> tuple[float, float]:
    """Over the measured steps, the group with each step's longest chain: on average how long
    after its version was published it was admitted (s), and its time from admission to
    completion over its least time (`workload.chain_s`)."""
    w, ends = run.setup.warmup_steps, run.step_end_s
    lags, stretch = [], []
    for i in range(w, len(ends)):
        version, admitted, done = run.step_chain_group[i]
        lags.append(admitted - (ends[version - 1] if version else 0.0))
        stretch.append((done - admitted) / max(run.step_chain_s[i], 1e-9))
    n = max(1, len(lags))
    return sum(lags) / n, sum(stretch) / n


def versions_per_step(run: Run) -> list[int]:
    """For each step, the most versions instances held at once while it was being produced."""
    ends = run.step_end_s
    out: list[int] = []
    segs = sorted((a, b, v) for _, a, b, v in run.segments if v >= 0)
    for i, end in enumerate(ends):
        start = ends[i - 1] if i else 0.0
        points = sorted(
            [(max(a, start), 1, v) for a, b, v in segs if a < end and b > start]
            + [(min(b, end), -1, v) for a, b, v in segs if a < end and b > start]
        )
        held: Counter[int] = Counter()
        best = 0
        for _, delta, v in points:  # ends sort before starts at the same instant
            held[v] += delta
            if held[v] == 0:
                del held[v]
            best = max(best, len(held))
        out.append(best)
    return out


def summarize(run: Run) -> dict[str, Any]:
    s = run.setup
    w = s.warmup_steps
    ends = run.step_end_s
    snaps = run.snapshots
    t0, base = (ends[w - 1], snaps[w - 1]) if w > 0 else (0.0, (0.0, 0.0, 0.0, 0.0, 0.0))
    window = ends[-1] - t0
    n_steps = len(ends) - w
    last = snaps[-1]
    tokens = sum(run.step_tokens[w:])
    step_s = window / n_steps
    inst = run.plan.instances
    bound, train, gen = bound_s(s, run, tokens / n_steps)
    chain = chain_bound_s(run)
    lag, stretch = longest_chains(run)
    path = chain_bound_path(run)
    hist = [0] * (run.plan.staleness + 1)
    for x in run.staleness:
        hist[x] += 1
    out: dict[str, Any] = {
        "mode": run.mode,
        "placement": "colocated" if run.plan.colocated else "disaggregated",
        "staleness_bound": run.plan.staleness,
        "instances": inst,
        "train_gpus": run.plan.train_gpus,
        "steps": len(ends),
        "measured_steps": n_steps,
        "step_min": step_s / 60.0,
        "tokens_per_s": tokens / window,
        "rollout_only_share": (last[4] - base[4]) / window,
        "instance_utilisation": (last[1] - base[1]) / (inst * window),
        "slot_use": (last[2] - base[2]) / (inst * s.max_seqs * window),
        "trainer_idle_share": max(0.0, 1.0 - (last[3] - base[3]) / window),
        "staleness_histogram": hist,
        "max_staleness": max(run.staleness),
        "version_span_histogram": {str(k): v for k, v in sorted(run.spans.items())},
        "versions_over_time": [
            {
                "step": i,
                "minute": e / 60.0,
                "instances_per_version": {str(v): n for v, n in d.items()},
            }
            for i, (e, d) in enumerate(zip(ends, run.versions, strict=True))
        ],
        "versions_held_per_step": versions_per_step(run),
        "max_versions_loaded": 0,
        "bound_min": bound / 60.0,
        "bound_train_min": train / 60.0,
        "bound_generation_min": gen / 60.0,
        "efficiency": bound / step_s,
        "chain_bound_min": chain / 60.0,
        "tight_bound_min": max(bound, chain) / 60.0,
        "tight_efficiency": max(bound, chain) / step_s,
        "chain_bound_path": path,
        "longest_chain_admit_lag_s": lag,
        "longest_chain_stretch": stretch,
        "migrations": run.migrations,
        "migrated_gb": run.migrated_gb,
        "preemptions": run.preemptions,
        "parks": run.parks,
        "loads": run.loads,
        "admission_waits": run.admission_waits,
        "accounting": run.accounting,
        "events": run.events,
    }
    out["max_versions_loaded"] = max(out["versions_held_per_step"])
    paper = PAPER.get(s.name, {}).get(run.mode)
    if paper is not None:
        out["paper"] = paper
        out["step_error"] = out["step_min"] / paper["step_min"] - 1.0
    return out


def _hist(h: list[int]) -> str:
    return " ".join(f"{i}:{n}" for i, n in enumerate(h))


def _versions(summary: dict[str, Any], last: int = 4) -> str:
    rows = summary["versions_over_time"][-last:]
    parts = []
    for r in rows:
        d = r["instances_per_version"]
        held = ",".join(f"v{v}x{n}" for v, n in sorted(d.items(), key=lambda x: -int(x[0])))
        parts.append(f"t{r['step']}[{held}]")
    return " ".join(parts)


def _rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    p = m.get("paper", {})

    def ref(key: str, fmt: str) -> str:
        return format(p[key], fmt) if key in p else ""

    # steps under a minute (the CPU presets) in seconds; the paper's are in minutes
    unit, scale = ("s", 60.0) if m["step_min"] < 1 else ("min", 1.0)

    rows = [
        (
            "placement",
            f"{m['placement']}, {m['instances']} instances, {m['train_gpus']} train GPUs",
            "",
        ),
        ("tokens/s", f"{m['tokens_per_s']:,.0f}", ref("tokens_per_s", ",.0f")),
        (f"step time ({unit})", f"{m['step_min'] * scale:.2f}", ref("step_min", ".2f")),
        ("rollout-only share", f"{m['rollout_only_share']:.0%}", ref("rollout_only", ".0%")),
        (
            "instance utilisation",
            f"{m['instance_utilisation']:.0%} (slots {m['slot_use']:.0%})",
            "",
        ),
        ("trainer idle share", f"{m['trainer_idle_share']:.0%}", ""),
        ("staleness histogram", _hist(m["staleness_histogram"]), f"K = {m['staleness_bound']}"),
        ("versions at step ends (last 4)", _versions(m), ""),
        (
            "versions held at once, per step",
            " ".join(str(n) for n in m["versions_held_per_step"]),
            f"max {m['max_versions_loaded']}",
        ),
        (
            f"bound per step ({unit})",
            f"{m['bound_min'] * scale:.2f} (train {m['bound_train_min'] * scale:.2f},"
            f" gen {m['bound_generation_min'] * scale:.2f})",
            "",
        ),
        ("efficiency vs bound", f"{m['efficiency']:.0%}", ""),
        (
            f"tight bound per step ({unit})",
            f"{m['tight_bound_min'] * scale:.2f}"
            f" (chains of turns {m['chain_bound_min'] * scale:.2f})",
            "",
        ),
        ("efficiency vs tight bound", f"{m['tight_efficiency']:.0%}", ""),
        ("chain bound waits for", m["chain_bound_path"], "last step first"),
        (
            "longest chain of a step",
            f"admitted {m['longest_chain_admit_lag_s']:.0f} s after its version,"
            f" took {m['longest_chain_stretch']:.2f}x its least time",
            "mean over measured steps",
        ),
        (
            "migrations / preemptions / parks",
            f"{m['migrations']} / {m['preemptions']} / {m['parks']}",
            "",
        ),
    ]
    if m["mode"] in ("partial", "inflight"):
        spans = " ".join(f"{k}:{v}" for k, v in m["version_span_histogram"].items())
        rows.append(("version span per trajectory", spans, ""))
    return rows


def render(summaries: list[dict[str, Any]], *, title: str, rich_ok: bool | None = None) -> str:
    """Tables, one per mode; rich when writing to a terminal, plain text otherwise."""
    if rich_ok is None:
        rich_ok = sys.stdout.isatty()
    if rich_ok:
        from rich.console import Console
        from rich.table import Table

        buf = io.StringIO()
        console = Console(file=buf, force_terminal=True, width=120)
        for m in summaries:
            table = Table(title=f"{title}: {m['mode']}", title_justify="left")
            table.add_column("metric")
            table.add_column("simulated")
            table.add_column("paper / note")
            for row in _rows(m):
                table.add_row(*row)
            console.print(table)
        return buf.getvalue()
    lines: list[str] = []
    for m in summaries:
        rows = _rows(m)
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines.append(f"== {title}: {m['mode']} ==")
        lines.append(f"{'metric':<{w0}}  {'simulated':<{w1}}  paper / note")
        lines.extend(f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows)
        lines.append("")
    return "\n".join(lines)


def setup_dict(setup: Setup) -> dict[str, Any]:
    return dataclasses.asdict(setup)


def write_plot(runs: list[Run], path: str, *, max_rows: int = 64) -> None:
    """A timeline per mode: instances (rows) x time, coloured by the version each holds; grey
    while loading; the trainer's busy time on the top row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.6 * len(runs)), squeeze=False)
    tab = plt.get_cmap("tab10")
    palette = [tab(i) for i in range(10) if i != 7]  # tab10's grey is the loading colour
    for ax, run in zip(axes[:, 0], runs, strict=True):
        n = run.plan.instances
        stride = max(1, -(-n // max_rows))
        rows = -(-n // stride)
        for idx, start, end, version in run.segments:
            if idx % stride:
                continue
            color = "0.8" if version < 0 else palette[version % len(palette)]
            ax.broken_barh([(start / 60, (end - start) / 60)], (idx // stride, 0.9), color=color)
        bars = [(a / 60, (b - a) / 60) for a, b in run.trainer]
        ax.broken_barh(bars, (rows + 0.5, 0.9), color="black")
        ax.set_ylim(0, rows + 1.6)
        ax.set_yticks([rows + 0.95])
        ax.set_yticklabels(["trainer"])
        ax.set_ylabel(f"instances ({n})" if stride == 1 else f"1 in {stride} of {n}")
        ax.set_title(f"{run.mode}: colour = version held (mod 9), grey = loading", loc="left")
        if run.step_end_s:
            ax.set_xlim(0, run.step_end_s[-1] / 60)
    axes[-1, 0].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
