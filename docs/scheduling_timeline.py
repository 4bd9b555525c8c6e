"""Draw docs/scheduling-timeline.png: the first worked example of docs/scheduling.md, replayed
through the real `TransferQueue` (K = 2, B = 1), one bar per group from admission to completion,
coloured by version, labelled with the step the queue assigned it to.

Run: python docs/scheduling_timeline.py [OUT.png]
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from dora.core import Admitted, TransferQueue

# (time, event, argument): the order of events of the worked example.
EVENTS: list[tuple[float, str, str]] = [
    (0.0, "admit", "g1"),
    (0.0, "admit", "g2"),
    (0.0, "admit", "g3"),
    (1.0, "complete", "g1"),
    (1.5, "train", "0"),
    (2.0, "admit", "g4"),
    (3.0, "complete", "g4"),
    (5.0, "complete", "g2"),
    (5.5, "train", "1"),
    (7.0, "complete", "g3"),
    (7.5, "train", "2"),
    (8.8, "train", "3"),
]


def replay() -> tuple[dict[str, tuple[float, float, int, int]], list[tuple[float, int]]]:
    q = TransferQueue(groups_per_step=1, max_staleness=2)
    q.on_version_loaded(0)
    start: dict[str, tuple[float, int]] = {}
    bars: dict[str, tuple[float, float, int, int]] = {}
    done: dict[str, float] = {}
    steps: list[tuple[float, int]] = []
    for when, kind, arg in EVENTS:
        if kind == "admit":
            out = q.try_admit(arg)
            assert isinstance(out, Admitted), out
            q.start(arg)
            start[arg] = (when, out.version)
        elif kind == "complete":
            done[arg] = when
            for a in q.complete(arg):
                t0, w = start[a.group_id]
                bars[a.group_id] = (t0, done[a.group_id], w, a.step)
        else:
            step = int(arg)
            q.on_step_done(step)
            q.on_version_loaded(step + 1)
            steps.append((when, step))
    return bars, steps


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else Path(__file__).with_name("scheduling-timeline.png")
    bars, steps = replay()
    colours = ["tab:blue", "tab:orange", "tab:green"]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = sorted(bars)
    for row, gid in enumerate(names):
        t0, t1, w, step = bars[gid]
        ax.barh(row, t1 - t0, left=t0, color=colours[w % len(colours)], edgecolor="black")
        ax.text(t1 + 0.1, row, f"v{w} -> step {step} (staleness {step - w})", va="center")
    for when, step in steps:
        ax.axvline(when, color="grey", linestyle=":")
        ax.text(when, 1.01, f"done({step})", transform=ax.get_xaxis_transform(), ha="center")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("time (arbitrary units)")
    ax.set_xlim(0, 11)
    ax.set_title("K = 2, B = 1: g4 finishes first but trains last; all deadlines met", pad=18)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
