"""Many emulated instances in one process, and how `dora serve` starts them.

`python -m dora.emulated --instances N --preset P ...` serves N `EmulatedInstance`s, each on its
own 127.0.0.1 port, from one event loop (128 of them fit on a 2-core machine: an instance costs
a timer and a few dicts, not a model). It prints one URL per line, then runs until SIGTERM or
SIGINT. Every instance shares one `EmulatedModel` and one `ScaledClock`. It measures its own
event-loop lag (a late timer is a late token) and writes a summary to `--stats` at exit.

`emulated_instances(config, count)` is the serve side: it starts that process, reads the URLs
within `serve.weight_load_timeout_s`, hands out `InstanceHandle`s with ordinary `EngineClient`s,
and stops the process (SIGTERM, a bounded wait, SIGKILL) on exit. Every instance starts holding
version 0. The URLs also go to `emulated-urls.txt` in the run directory: a colocated emulated
trainer pauses the instances there while it trains (`emulate.colocated`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from dora.config import DoraConfig
from dora.errors import ServerTimeout, ServerUnavailable
from dora.sim.costs import Setup, apply_overrides, preset

__all__ = ["emulated_instances", "emulated_setup", "main", "urls_path"]

log = logging.getLogger("dora.emulated")
_LAG_EVERY_S = 0.05


def urls_path(run_dir: Path) -> Path:
    """The file listing the instances' URLs, one a line, in the run directory."""
    return run_dir / "emulated-urls.txt"


def emulated_setup(config: DoraConfig) -> Setup:
    """The cost model of `emulate.preset` with `emulate.overrides` (one source of truth)."""
    return apply_overrides(preset(config.emulate.preset), list(config.emulate.overrides))


async def _lag_probe(samples: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + _LAG_EVERY_S
        await asyncio.sleep(_LAG_EVERY_S)
        samples.append(max(0.0, loop.time() - due) * 1000.0)


async def _serve(args: argparse.Namespace) -> dict[str, object]:
    from aiohttp import web

    from dora.emulated.engine import EmulatedInstance, ScaledClock
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
    lags: list[float] = []
    started = time.process_time()
    try:
        for i in range(args.instances):
            inst = EmulatedInstance(name=f"i{i}", setup=setup, clock=clock, model=model, version=0)
            instances.append(inst)
            runner = web.AppRunner(
                EmulatedServer(inst).app,
                access_log=None,
                handle_signals=False,
                keepalive_timeout=300.0,  # the client (120 s) closes idle connections first
            )
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            print(f"http://{host}:{port}", flush=True)
        probe = asyncio.create_task(_lag_probe(lags))
        await stop.wait()
        probe.cancel()
    finally:
        for runner in runners:
            await runner.cleanup()
    ordered = sorted(lags) or [0.0]
    return {
        "instances": len(instances),
        "cpu_s": time.process_time() - started,
        "loop_lag_ms_median": statistics.median(ordered),
        "loop_lag_ms_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
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


# --- the serve side ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def emulated_instances(
    config: DoraConfig, model_dir: str, *, count: int, stats_path: Path | None = None
) -> AsyncIterator[list[object]]:
    """Start one emulated-cluster process of `count` instances; yield their `InstanceHandle`s."""
    from transformers import AutoTokenizer

    from dora.engine.client import EngineClient
    from dora.serve.instances import InstanceHandle

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    specials = [int(t) for t in tokenizer.all_special_ids]
    first = max(specials) + 1 if specials else 0
    e = config.emulate
    args = [
        *("-m", "dora.emulated", "--instances", str(count), "--preset", e.preset),
        *("--time-scale", repr(e.time_scale), "--seed", str(e.seed)),
        *("--vocab-size", str(len(tokenizer)), "--first-token", str(first)),
    ]
    for item in e.overrides:
        args += ["--override", item]
    if stats_path is not None:
        args += ["--stats", str(stats_path)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL
    )
    assert proc.stdout is not None
    handles: list[InstanceHandle] = []
    timeout_s = config.serve.weight_load_timeout_s

    async def stop_one() -> None:
        """Instances share the process: one is stopped with all of them, at exit."""

    try:
        for i in range(count):
            try:
                async with asyncio.timeout(timeout_s):
                    line = (await proc.stdout.readline()).decode().strip()
            except TimeoutError:
                raise ServerTimeout(
                    f"the emulated cluster (pid {proc.pid}) did not print instance {i}'s URL "
                    f"within {timeout_s:g} s"
                ) from None
            if not line.startswith("http"):
                raise ServerUnavailable(
                    f"the emulated cluster (pid {proc.pid}) exited ({proc.returncode}) after "
                    f"{i} of {count} instances"
                )
            client = EngineClient(
                line,
                timeout_s=config.serve.request_timeout_s,
                control_timeout_s=config.serve.weight_load_timeout_s,
            )
            handles.append(InstanceHandle(id=f"i{i}", url=line, client=client, stop=stop_one))
        log.info("emulated cluster (pid %d): %d instances", proc.pid, count)
        if stats_path is not None:  # where a colocated emulated trainer finds the instances
            urls_path(stats_path.parent).write_text("".join(h.url + "\n" for h in handles))
        yield list(handles)
    finally:
        for h in handles:
            await h.client.close()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                async with asyncio.timeout(10.0):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
