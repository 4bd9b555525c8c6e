"""Which of a run's processes are runnable, sampled every 10 ms: where a machine's idle cores go.

Runs a command (a `dora bench modes` run, a `dora run`) and, while it runs, reads the state of
every thread of every process under it from /proc. Afterwards, over one run directory's steady
window (its first to its last `trained` record, as `dora bench modes` measures), it prints the
share of samples with 0, 1, 2, 3 and 4+ runnable processes, and which processes were the only
runnable ones: on a machine of N cores, a sample with fewer than N runnable processes had a core
idle, and the lone process names who was working meanwhile. Processes are told apart by their
command line: `serve`, `learn`, `engine` (an embedded engine instance), else the program name.

    python scripts/runnable-trace.py --run-dir /tmp/bd/dora -- \\
        dora bench modes examples/math/bench.toml --modes dora --out /tmp/bd

The sampler takes a little CPU itself (a few percent of a core), and a process counts as
runnable whether it is running or waiting for a core, so the counts are of demand, not of use.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import time
from pathlib import Path

INTERVAL_S = 0.01


def _children(root: int) -> set[int]:
    """`root` and every process under it, now."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(stat[stat.rindex(")") + 2 :].split()[1])].append(int(entry))
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += parents.get(pid, [])
    return seen


def _kind(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"
    for name, marker in (("serve", "cli serve"), ("learn", "cli learn"), ("engine", "dora.engine")):
        if marker in cmd:
            return name
    return Path(cmd.split(" ")[0]).name or "?"


def _runnable(pid: int) -> bool:
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            if stat[stat.rindex(")") + 2] == "R":
                return True
    except OSError:
        pass
    return False


def trace(command: list[str]) -> list[tuple[float, list[str]]]:
    """Run `command`; every INTERVAL_S, the kinds of its runnable processes (wall-clock time)."""
    proc = subprocess.Popen(command)
    samples: list[tuple[float, list[str]]] = []
    kinds: dict[int, str] = {}
    tree: set[int] = set()
    refreshed = 0.0
    while proc.poll() is None:
        now = time.time()
        if now - refreshed > 0.5:  # processes come and go: look for them twice a second
            tree, refreshed = _children(proc.pid) - {proc.pid}, now
            kinds = {pid: kinds.get(pid) or _kind(pid) for pid in tree}
        samples.append((now, [kinds[pid] for pid in tree if _runnable(pid)]))
        time.sleep(INTERVAL_S)
    return samples


def window(run_dir: Path) -> tuple[float, float]:
    """The steady window of a run (wall-clock): its first and last `trained` records."""
    records = [json.loads(line) for line in (run_dir / "rollout.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["kind"] == "serve_start")
    base = start["unix_time"] - start["time_s"]
    trained = [r["time_s"] for r in records if r["kind"] == "trained"]
    return base + min(trained), base + max(trained)


def summary(samples: list[tuple[float, list[str]]], t0: float, t1: float) -> list[str]:
    inside = [kinds for t, kinds in samples if t0 <= t <= t1]
    if not inside:
        return ["no sample inside the run's steady window"]
    n = len(inside)
    counts = collections.Counter(min(len(k), 4) for k in inside)
    alone = collections.Counter(k[0] for k in inside if len(k) == 1)
    lines = [f"{n} samples over {t1 - t0:.1f} s"]
    for c in range(5):
        lines.append(f"  {c}{'+' if c == 4 else ''} runnable: {100 * counts[c] / n:.1f}%")
    lines += [f"  only {kind} runnable: {100 * m / n:.1f}%" for kind, m in alone.most_common()]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", type=Path, required=True, help="the run whose window to read")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    samples = trace(command)
    for line in summary(samples, *window(args.run_dir)):
        print(line)


if __name__ == "__main__":
    main()
