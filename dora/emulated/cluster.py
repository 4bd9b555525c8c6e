"""Many emulated instances in one process.

`python -m dora.emulated --instances N --preset P ...` serves N `EmulatedInstance`s, each on its
own 127.0.0.1 port, from one event loop (128 of them fit on a 2-core machine: an instance costs
a timer and a few dicts, not a model). It prints one URL per line, then runs until SIGTERM or
SIGINT. Every instance shares one `EmulatedModel` and one `ScaledClock`. It measures its own
event-loop lag (a late timer is a late token) and writes a summary to `--stats` at exit.

Serve starts this process and talks to its instances over HTTP as to any engine
(`dora.serve.emulated_cluster`); nothing here imports serve or the trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import statistics
import sys
import time
from pathlib import Path

from dora.costs import apply_overrides, preset
from dora.gc_settings import collector_clock, peak_rss_mb, settle_heap
from dora.instance.transport import SERVER_KEEPALIVE_S
from dora.looplag import LoopProbe, p99

__all__ = ["main"]

log = logging.getLogger("dora.emulated")
_LAG_EVERY_S = 0.05


async def _serve(args: argparse.Namespace) -> dict[str, object]:
    from aiohttp import web

    from dora.emulated.instance import EmulatedInstance, ScaledClock
    from dora.emulated.model import EmulatedModel
    from dora.emulated.server import EmulatedServer

    setup = apply_overrides(preset(args.preset), list(args.override))
    loop = asyncio.get_running_loop()
    clock = ScaledClock(args.time_scale, loop)
    model = EmulatedModel(
        setup, seed=args.seed, vocab_size=args.vocab_size, first_token=args.first_token
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runners: list[web.AppRunner] = []
    instances: list[EmulatedInstance] = []
    probe = LoopProbe(_LAG_EVERY_S, keep_samples=True)
    started, began = time.process_time(), time.monotonic()
    try:
        for i in range(args.instances):
            inst = EmulatedInstance(name=f"i{i}", setup=setup, clock=clock, model=model, version=0)
            instances.append(inst)
            runner = web.AppRunner(
                EmulatedServer(inst).app,
                access_log=None,
                handle_signals=False,
                keepalive_timeout=SERVER_KEEPALIVE_S,  # the client closes idle connections first
            )
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            print(f"http://{host}:{port}", flush=True)
        settle_heap()
        probe_task = asyncio.create_task(probe.run())
        async with collector_clock():
            await stop.wait()
        probe_task.cancel()
    finally:
        for runner in runners:
            await runner.cleanup()
    ordered = sorted(probe.samples) or [0.0]
    return {
        "instances": len(instances),
        "cpu_s": time.process_time() - started,
        "wall_s": time.monotonic() - began,
        "peak_rss_mb": peak_rss_mb(),
        "loop_lag_ms_median": statistics.median(ordered),
        "loop_lag_ms_p99": p99(ordered),
        "generated_tokens": sum(i.generated for i in instances),
        "preemptions": sum(i.preemptions for i in instances),
        "busy_s": [round(i.busy_s, 3) for i in instances],
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dora.emulated", description=__doc__.split("\n")[0])
    p.add_argument("--instances", type=int, required=True)
    p.add_argument("--preset", default="paper-64")
    p.add_argument("--override", action="append", default=[], metavar="key=value")
    p.add_argument("--time-scale", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--first-token", type=int, default=0)
    p.add_argument("--stats", default="", help="write the process's own measurements here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.instances < 1 or args.time_scale <= 0:
        print("--instances must be >= 1 and --time-scale > 0", file=sys.stderr)
        return 2
    stats = asyncio.run(_serve(args))
    if args.stats:
        Path(args.stats).write_text(json.dumps(stats))
    return 0
