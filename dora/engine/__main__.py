"""`python -m dora.engine --model DIR --port 0 --version 0 --threads 1`: run one engine instance.

When it serves, it prints exactly one line to stdout, the base URL (e.g. `http://127.0.0.1:41234`),
so a parent that started it with port 0 can read where it listens. SIGTERM and SIGINT stop it
cleanly (running requests end with finish_reason "abort"). Started with `DORA_PARENT_PID` (what
`dora serve` does), it dies with that parent (`dora/lifetime.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from dora.engine.batcher import BatcherConfig
from dora.gc_settings import settle_heap
from dora.lifetime import die_with_parent_from_env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dora.engine", description="Run one dora engine instance."
    )
    p.add_argument("--model", required=True, help="Hugging Face causal-LM folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--version", type=int, default=0, help="weight version of the model in --model")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--max-kv-tokens", type=int, default=None, help="default: --max-kv-gib worth")
    p.add_argument("--max-kv-gib", type=float, default=4.0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--stall-s",
        type=float,
        default=10.0,
        help="/health answers 503 once one engine step or command lasts longer (loads excepted)",
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="weights"
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model runs: cpu, or cuda (the first GPU of CUDA_VISIBLE_DEVICES)",
    )
    p.add_argument(
        "--control-token-env",
        default="DORA_ENGINE_TOKEN",
        help="environment variable with the bearer token for /control (unset: loopback only)",
    )
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    from dora.engine.server import EngineServer

    config = BatcherConfig(
        max_running=args.max_running,
        max_kv_tokens=args.max_kv_tokens,
        max_kv_bytes=int(args.max_kv_gib * (1 << 30)),
        max_model_len=args.max_model_len,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with EngineServer.start(
        args.model,
        host=args.host,
        port=args.port,
        version=args.version,
        threads=args.threads,
        dtype=args.dtype,
        device=args.device,
        config=config,
        control_token=os.environ.get(args.control_token_env) or None,
        stall_s=args.stall_s,
    ) as server:
        settle_heap()
        print(server.url, flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    die_with_parent_from_env()  # the serve that started it, killed, leaves no engine behind
    asyncio.run(serve(parse_args(argv)))
    return 0


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown. By now the server has closed and every request
    has its answer; what is left is garbage-collecting torch and the model, a second on a quiet
    machine and over ten under load with adapters, which the parent waiting on SIGTERM would pay
    for (serve kills an instance that takes too long)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
