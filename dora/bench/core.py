"""`dora bench core`: how many scheduling events per second the transfer queue handles.

One event is one admission, one completion or one assignment. The driver keeps `--in-flight`
groups running, completes them in a pseudo-random order (so assignments happen out of order and
the invariant check does real work), acknowledges each step as soon as it closes (a trainer that
is never the bottleneck), loads every new version at once and marks steps durable, so memory
stays flat. It stops after `--events` events and prints the rate.

The last line is `core events/s: N` (parsed by CI and docs).
"""

from __future__ import annotations

import argparse
import random
import time

from dora.core import Admitted, TransferQueue


def run(*, events: int, groups_per_step: int, max_staleness: int, in_flight: int, seed: int) -> int:
    """Drive `events` events through a queue; returns the number of steps filled."""
    rng = random.Random(seed)
    q = TransferQueue(groups_per_step=groups_per_step, max_staleness=max_staleness)
    q.on_version_loaded(0)
    running: list[str] = []
    done = 0
    n = 0
    trained = -1
    while done < events:
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
            q.on_durable(trained)
    return q.step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dora bench core", description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000, help="events to drive")
    p.add_argument("--groups-per-step", type=int, default=64, help="B")
    p.add_argument("--max-staleness", type=int, default=3, help="K")
    p.add_argument("--in-flight", type=int, default=256, help="groups kept running")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start = time.perf_counter()
    steps = run(
        events=args.events,
        groups_per_step=args.groups_per_step,
        max_staleness=args.max_staleness,
        in_flight=args.in_flight,
        seed=args.seed,
    )
    elapsed = time.perf_counter() - start
    print(
        f"{args.events} events (B={args.groups_per_step}, K={args.max_staleness}, "
        f"in flight {args.in_flight}), {steps} steps in {elapsed:.2f} s"
    )
    print(f"core events/s: {args.events / elapsed:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
