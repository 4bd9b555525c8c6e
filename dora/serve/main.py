"""`dora serve CONFIG [key=value ...]`: the rollout side of a run.

Starts `serve.instances` embedded engine processes (version 0 is the run's initial model from
`dora.models.prepare`: `model.path`, or the tiny model, warmed up if asked; the engines bind
127.0.0.1 whatever `serve.host` says, see `instances.py`), binds the trainer link on
`serve.host:serve.port` (with the CURVE keys, token and message size limit of `serve.*`; off
loopback it needs the keys), drops the tasks whose prompt cannot fit `model.max_model_len`
(`dora.data.fit_context`; counted as `prompts_skipped` in the summary), and runs the rollout
loop (`rollout.py`) until every step of `learn.steps` is filled, sent and acknowledged; with
`data.eval_source` set, `data.eval_size` held-out tasks are evaluated greedily every
`data.eval_every` steps (`evaluate.py`). Metrics go to `{run_dir}/rollout.jsonl` and
`{run_dir}/summary.json`; the live display goes to the terminal when `log.progress` is on and
stderr is a terminal.

The run directory's `serve.lock` is held while it runs (`dora/rundir.py`: a second serve on
the directory is refused naming this one's pid; under `dora run` the lock is `dora run`'s).
With `--resume` (what `dora run` passes to a restarted serve) the journal must be there: a
restart that would silently begin the run again is refused instead.

The trainer connects to the address printed at start (`dora run` chooses the port and passes it to
both sides). Stopping (Ctrl-C, SIGTERM, or an error) cancels the task group and stops every
instance process by its handle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec

from dora.config import DoraConfig
from dora.config_text import default_sections
from dora.dryrun import count_gpus
from dora.errors import ConfigError
from dora.gc_settings import collector_clock, settle_heap
from dora.gpu_plan import PINNED, GpuPlan, plan_gpus, visible_devices
from dora.lifetime import mark_ready
from dora.records import write_summary
from dora.resume import check_resumable, keep_run_config
from dora.rundir import own_run_dir, resolve_run_dir
from dora.secret import with_run_token
from dora.serve.instances import (
    InstanceHandle,
    InstanceSpec,
    ProcessPool,
    attach,
    start_processes,
)

__all__ = ["main", "run_serve"]

log = logging.getLogger("dora.serve")


Replace = Callable[[str], Awaitable[InstanceHandle]]


@contextlib.asynccontextmanager
async def _instances(
    config: DoraConfig, model_dir: Path, *, run_dir: Path, plan: GpuPlan | None
) -> AsyncIterator[tuple[list[InstanceHandle], Replace | None]]:
    """The instances of the configured backend (started here, or attached at `serve.urls`), and
    how to replace one that died (only for engine processes that this serve started)."""
    if plan is None and config.serve.backend != "emulated":
        # a config object without a command line: its counts as they are
        plan = plan_gpus(config, visible_devices(os.environ, count_gpus()), PINNED)
    if config.serve.backend == "vllm":
        try:
            from dora.vllm.launcher import vllm_instances
        except ImportError as exc:
            raise ConfigError(
                f"serve.backend = 'vllm' is not available in dora serve yet ({exc}); use 'embedded'"
            ) from exc
        assert plan is not None
        log_dir = str(run_dir / "vllm")
        async with vllm_instances(config, str(model_dir), plan=plan, log_dir=log_dir) as vh:
            yield list(vh), None
        return
    if config.serve.backend == "emulated":
        from dora.serve.emulated_cluster import emulated_instances

        stats = run_dir / "emulated-cluster.json"
        count = config.serve.instances
        async with emulated_instances(config, str(model_dir), count=count, stats_path=stats) as eh:
            yield eh, None  # type: ignore[misc]
        return
    spec = InstanceSpec.from_config(config, model_dir, plan=plan)
    if config.serve.urls:
        async with attach(spec, config.serve.urls) as handles:
            yield handles, None
        return
    async with start_processes(spec, config.serve.instances) as pool:
        assert isinstance(pool, ProcessPool)
        yield list(pool.handles), pool.replace


async def run_serve(
    config: DoraConfig,
    *,
    run_dir: Path,
    progress: bool | None = None,
    plan: GpuPlan | None = None,
) -> object:
    """The whole rollout side; returns the `RolloutReport`."""
    from transformers import AutoTokenizer

    from dora.data import config_tasks, fit_context
    from dora.env import PromptStream, load_env
    from dora.episode import ChatRenderer
    from dora.link import ServeLink
    from dora.models.prepare import prepare_model
    from dora.serve.metrics import SampleLog
    from dora.serve.rollout import Rollout

    # The initial weights the trainer starts from too (built, warmed up and cached once, under a
    # lock, by whichever side comes first): version 0 must be the same on both sides.
    model_dir = await asyncio.to_thread(prepare_model, config)
    # The environment's setup() and task source are user code: off the loop, as its hooks are.
    env_factory = await asyncio.to_thread(load_env, config.env.cls, **config.env.kwargs)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(model_dir))
    renderer = ChatRenderer(tokenizer, add_special_tokens=config.env.prompt_special_tokens)
    # Rows whose prompt cannot fit are left out before the prompt stream is built, so a restarted
    # serve (same data, same tokenizer) drops the same rows and its journaled position still holds.
    train = await fit_context(
        await asyncio.to_thread(config_tasks, config.data, env_factory),
        env_factory=env_factory,
        renderer=renderer,
        context_limit=config.model.max_model_len,
    )
    tasks = PromptStream(train.tasks, seed=config.data.seed, shuffle=config.data.shuffle)
    eval_tasks = []
    eval_skipped = 0
    if config.data.eval_source and config.data.eval_size > 0:
        held_out = await fit_context(
            await asyncio.to_thread(config_tasks, config.data, env_factory, held_out=True),
            env_factory=env_factory,
            renderer=renderer,
            context_limit=config.model.max_model_len,
            key="data.eval_source",
        )
        eval_tasks, eval_skipped = held_out.tasks, len(held_out.skipped)
    serve_link = ServeLink.from_config(config.serve)
    if progress is None:
        progress = config.log.progress and sys.stderr.isatty()
    try:
        print(f"dora serve: trainer link on {serve_link.address}", flush=True)
        instances = _instances(config, model_dir, run_dir=run_dir, plan=plan)
        async with instances as (handles, replace):
            rollout = Rollout(
                config,
                instances=handles,
                link=serve_link,
                model_dir=str(model_dir),
                run_dir=run_dir,
                tasks=tasks,
                env_factory=env_factory,
                renderer=renderer,
                eval_tasks=eval_tasks,
                progress=progress,
                replace_instance=replace,
                prompts_skipped=len(train.skipped),
                eval_prompts_skipped=eval_skipped,
                sample_log=SampleLog(
                    run_dir, every=config.log.samples_every, decode=renderer.decode
                )
                if config.log.samples_every
                else None,
            )
            mark_ready()  # instances up, prompts measured: a failure from now on is a fault
            settle_heap()
            async with collector_clock():
                report = await rollout.run()
    finally:
        serve_link.close()
    write_summary(run_dir / "summary.json", report)
    return report


def main(args: argparse.Namespace) -> int:
    """`dora serve`: 0 when the run finished."""
    from dora.dryrun import planned

    start = planned(args.config, args.overrides)
    config = start.config
    for note in default_sections(start.raw):
        print(f"dora serve: {note}", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    resume = getattr(args, "resume", False)
    run_dir = resolve_run_dir(config, resume=resume)
    with own_run_dir(run_dir, ("serve",), command="dora serve"):
        if resume:
            check_resumable(run_dir, config=False)
        keep_run_config(run_dir, config, resume=resume)
        return _serve(config, run_dir, start.plan)


def _serve(config: DoraConfig, run_dir: Path, plan: GpuPlan) -> int:
    config = with_run_token(config, run_dir)
    print(f"dora serve: run directory {run_dir}", flush=True)
    if not config.serve.token:
        log.warning(
            "no serve.token and no run secret in %s: the trainer link and the control routes of "
            "the engines serve starts admit any local process (dora run makes a run secret)",
            run_dir,
        )

    async def serve() -> object:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        return await run_serve(config, run_dir=run_dir, plan=plan)

    try:
        report = asyncio.run(serve())
    except asyncio.CancelledError:
        print("dora serve: stopped", file=sys.stderr)
        return 130
    from dora.serve.console import summary_table

    print(
        f"dora serve: finished ({run_dir / 'summary.json'}):\n"
        f"{summary_table(msgspec.to_builtins(report))}",
        flush=True,
    )
    return 0
