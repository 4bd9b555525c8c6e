"""`dora bench core`: how many scheduling events per second the transfer queue handles.

One event is one admission, one completion or one assignment. The driver keeps `--in-flight`
groups running (or as many as the gate admits: at most about `(K + 1) * B`), completes them in a
pseudo-random order (so assignments happen out of order and the invariant check does real
work), acknowledges each step as soon as it closes (a trainer that is never the bottleneck),
loads every new version at once, reads the per-version counts once a step (serve does, to know
which weights to keep) and marks steps durable, so memory stays flat. It stops after `--events`
events, or once `--steps` steps are filled, and prints the rate.

Per-event costs must not grow with the length of a run: with `--steps`, the rate over a window of
`--window` steps early in the run (steps W to 2W, once the pipeline has filled and the queue holds
its steady number of groups; steps 0 to W in a run shorter than 3W) and over the last W steps are
printed too (same process), per second of wall time and per second of the process's CPU time.
On a shared machine the load changes between the two windows, and only the CPU rate compares
their costs.

The last line is `core events/s: N` (parsed by CI and docs).
"""

from __future__ import annotations

import argparse
import random
import time

from dora.bench import summary
from dora.core import Admitted, TransferQueue


def run(
    *,
    events: int | None,
    groups_per_step: int,
    max_staleness: int,
    in_flight: int,
    seed: int,
    steps: int | None = None,
    marks: list[tuple[int, int, float, float]] | None = None,
) -> tuple[int, int]:
    """Drive events through a queue until `events` events or `steps` filled steps; returns
    (events, steps filled). `marks` gets (step, events so far, perf_counter, process_time) as
    steps close."""
    if events is None and steps is None:
        raise ValueError("give events or steps")
    rng = random.Random(seed)
    q = TransferQueue(groups_per_step=groups_per_step, max_staleness=max_staleness)
    q.on_version_loaded(0)
    running: list[str] = []
    done = 0
    n = 0
    trained = -1
    limit = events if events is not None else 1 << 62
    last = steps if steps is not None else 1 << 62
    if marks is not None:
        marks.append((0, 0, time.perf_counter(), time.process_time()))
    while done < limit and q.step < last:
        while len(running) < in_flight:
            gid = f"g{n}"
            if not isinstance(q.try_admit(gid), Admitted):
                break
            n += 1
            q.start(gid)
            running.append(gid)
            done += 1
        if not running:
            raise RuntimeError(f"nothing running at step {q.step}: the queue is stuck")
        i = rng.randrange(len(running))
        running[i], running[-1] = running[-1], running[i]
        done += 1 + len(q.complete(running.pop()))
        while trained + 1 < q.step:
            trained += 1
            q.on_step_done(trained)
            q.on_version_loaded(trained + 1)
            q.version_counts()
            q.on_durable(trained)
            if marks is not None:
                marks.append((trained + 1, done, time.perf_counter(), time.process_time()))
    return done, q.step


def window_rate(
    marks: list[tuple[int, int, float, float]], lo: int, hi: int, *, cpu: bool = False
) -> float:
    """Events per second (of wall time, or with `cpu` of the process's CPU time) between the
    closes of steps `lo` and `hi` (indexes into `marks`)."""
    (_, e0, t0, c0), (_, e1, t1, c1) = marks[lo], marks[hi]
    return (e1 - e0) / max((c1 - c0) if cpu else (t1 - t0), 1e-9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dora bench core", description=summary(__doc__))
    p.add_argument("--events", type=int, default=None, help="events to drive (default 1e6)")
    p.add_argument("--steps", type=int, default=None, help="or: steps to fill")
    p.add_argument("--window", type=int, default=100, help="steps per rate window (--steps)")
    p.add_argument("--groups-per-step", type=int, default=64, help="B")
    p.add_argument("--max-staleness", type=int, default=3, help="K")
    p.add_argument("--in-flight", type=int, default=256, help="groups kept running")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    events = args.events if args.events is not None or args.steps else 1_000_000
    marks: list[tuple[int, int, float, float]] = []
    start = time.perf_counter()
    done, steps = run(
        events=events,
        groups_per_step=args.groups_per_step,
        max_staleness=args.max_staleness,
        in_flight=args.in_flight,
        seed=args.seed,
        steps=args.steps,
        marks=marks,
    )
    elapsed = time.perf_counter() - start
    print(
        f"{done} events (B={args.groups_per_step}, K={args.max_staleness}, "
        f"in flight {args.in_flight}), {steps} steps in {elapsed:.2f} s"
    )
    w = min(args.window, len(marks) - 1)
    if args.steps is not None and w > 0:
        last = len(marks) - 1
        lo = w if last >= 3 * w else 0
        early = f"steps {lo}-{lo + w}"
        first, final = window_rate(marks, lo, lo + w), window_rate(marks, last - w, last)
        print(f"events/s over {early}: {first:.0f}; over the last {w} steps: {final:.0f}")
        first, final = (
            window_rate(marks, lo, lo + w, cpu=True),
            window_rate(marks, last - w, last, cpu=True),
        )
        print(
            f"events per CPU-second over {early}: {first:.0f}; "
            f"over the last {w} steps: {final:.0f} (ratio {final / first:.2f})"
        )
    print(f"core events/s: {done / elapsed:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
