"""`dora runner --connect ADDRESS CONFIG [key=value ...]`: one episode runner for a serve.

The runner reads the run's config (the environment, the model whose tokenizer renders the
episodes, the limits, and the link's CURVE keys and token) and runs the episodes that the
`dora serve` listening on ADDRESS (`serve.runner_port`) sends it (`runner_episodes.py`). Its
token is `DORA_RUNNER_TOKEN` when serve started it, else `serve.token`, else the run's secret in
`log.run_dir` (`dora.secret`). It stops when serve goes away, on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import msgspec

from dora.config import DoraConfig, load_config
from dora.secret import with_run_token

__all__ = ["main", "run_runner"]

log = logging.getLogger("dora.runner")


async def run_runner(config: DoraConfig, *, address: str, name: str, token: str) -> int:
    """Run one runner until serve goes away; how many episodes it ran."""
    from transformers import AutoTokenizer

    from dora.env import load_env
    from dora.episode import ChatRenderer
    from dora.models.prepare import prepare_model
    from dora.serve.dispatcher import episode_limits
    from dora.serve.runner_episodes import EpisodeRunner

    model_dir = await asyncio.to_thread(prepare_model, config)
    env_factory = await asyncio.to_thread(load_env, config.env.cls, **config.env.kwargs)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(model_dir))
    runner = EpisodeRunner(
        address=address,
        name=name,
        token=token,
        config=config,
        env_factory=env_factory,
        renderer=ChatRenderer(tokenizer, add_special_tokens=config.env.prompt_special_tokens),
        limits=episode_limits(config),
    )
    try:
        await runner.run()
    finally:
        runner.close()
    return runner.episodes_run


def main(args: argparse.Namespace) -> int:
    """`dora runner`: 0 when serve ended the run; 1 when it could not be reached."""
    from dora.errors import DoraError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = load_config(args.config, args.overrides)
    if config.log.run_dir:
        config = with_run_token(config, Path(config.log.run_dir))
    token = os.environ.pop("DORA_RUNNER_TOKEN", "") or config.serve.token
    # the same token authenticates its calls to the instances serve started
    config = msgspec.structs.replace(
        config, serve=msgspec.structs.replace(config.serve, token=token)
    )
    name = args.name or f"{socket.gethostname()}-{os.getpid()}"

    async def runner() -> int:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        return await run_runner(config, address=args.connect, name=name, token=token)

    try:
        ran = asyncio.run(runner())
    except asyncio.CancelledError:
        print(f"dora runner {name}: stopped", file=sys.stderr)
        return 130
    except DoraError as exc:
        print(f"dora runner {name}: {exc}", file=sys.stderr)
        return 1
    print(f"dora runner {name}: {ran} episodes", flush=True)
    return 0
