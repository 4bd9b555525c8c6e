"""`dora learn CONFIG [key=value ...] [--resume]`: the trainer's entry point.

With `learn.processes > 1` and no distributed environment yet, it re-launches itself under
`torchrun --standalone --nproc_per_node N` (real gloo ranks on a CPU machine; `accelerate launch
--cpu` would silently run one process) and returns torchrun's exit status. Every rank then runs
this module with the same arguments, plus the resolved run directory.

torchrun starts each rank in a session of its own, so killing the process group of `dora learn`
(what `dora run` does to a failed trainer) would not reach them. On Linux every link of the chain
dies with its parent instead (`PR_SET_PDEATHSIG`): torchrun gets SIGTERM when `dora learn` dies
(and stops its ranks), and every rank gets SIGKILL when its launcher dies, so a killed trainer
never leaves ranks behind that hold their cores and wait on a link that serve no longer serves.

The run directory's `learn.lock` is held while the trainer runs (`dora/rundir.py`): by `dora
learn` itself, whose ranks die with it, or by rank 0 under another launcher (`accelerate launch`,
torchrun); under `dora run` by `dora run`. A second trainer on the directory is refused naming
the first one's pid: two trainers would write one checkpoint folder.

Rank 0 connects to dora serve at `$DORA_SERVE_ADDRESS` when set (what `dora run` does, since serve
may bind port 0), else `tcp://{serve.host}:{serve.port}`.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from dora.config import DoraConfig, load_config
from dora.errors import ConfigError
from dora.gc_settings import settle_heap
from dora.lifetime import die_with_parent
from dora.rundir import own_run_dir, resolve_run_dir
from dora.secret import with_run_token

ADDRESS_ENV = "DORA_SERVE_ADDRESS"


def serve_address(config: DoraConfig) -> str:
    """Where rank 0 finds dora serve."""
    address = os.environ.get(ADDRESS_ENV, "")
    if address:
        return address
    if config.serve.port == 0:
        raise ConfigError(
            f"serve.port = 0 leaves the trainer no address: set serve.port to the port dora serve "
            f"binds, or {ADDRESS_ENV}=tcp://host:port (dora run sets it)"
        )
    return f"tcp://{config.serve.host}:{config.serve.port}"


def _in_distributed_env() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def _launch(
    config: DoraConfig, args: argparse.Namespace, run_dir: Path, lock_env: dict[str, str]
) -> int:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(config.learn.processes),
        "-m",
        "dora.cli",
        "learn",
        str(args.config),
        *args.overrides,
        f"log.run_dir={run_dir}",
    ]
    if args.resume:
        command.append("--resume")
    env = dict(os.environ, OMP_NUM_THREADS=str(config.learn.threads), **lock_env)
    return subprocess.run(
        command, env=env, check=False, preexec_fn=lambda: die_with_parent(signal.SIGTERM)
    ).returncode


def check_ranks_fit(config: DoraConfig, gpus: int) -> None:
    """On a machine with `gpus` GPUs every rank takes one of its own (NCCL refuses two ranks on
    one GPU, after its timeout); the emulated trainer computes nothing on them."""
    n = config.learn.processes
    if gpus and n > gpus and not config.emulate.trainer:
        raise ConfigError(
            f"learn.processes = {n} ranks, but this machine has {gpus} GPU(s) and each rank takes "
            f"one: set learn.processes to {gpus} or fewer"
        )


def main(args: argparse.Namespace) -> int:
    """Run the trainer (or launch its ranks); 0 when it trained its steps or serve shut it down."""
    if _in_distributed_env():  # a rank: its launcher planned and set its GPUs
        config = load_config(args.config, args.overrides)
    else:
        from dora.dryrun import planned, trainer_environment

        start = planned(args.config, args.overrides)
        config, args.overrides = start.config, start.overrides
        os.environ.update(trainer_environment(start.plan))  # before torch reads it
    import torch

    run_dir = resolve_run_dir(config, resume=args.resume)
    config = with_run_token(config, run_dir)  # the hello's token: serve.token or the run's secret
    check_ranks_fit(config, torch.cuda.device_count())
    owns = int(os.environ.get("RANK", "0")) == 0  # the other ranks run under rank 0's lock
    with own_run_dir(run_dir, ("learn",) if owns else (), command="dora learn") as owner:
        if config.learn.processes > 1 and not _in_distributed_env():
            return _launch(config, args, run_dir, owner.env)
        return _train(config, args, run_dir)


def _train(config: DoraConfig, args: argparse.Namespace, run_dir: Path) -> int:
    if _in_distributed_env():
        die_with_parent(signal.SIGKILL)
    address = serve_address(config)
    from transformers.utils import logging as hf_logging

    from dora.learn.trainer import Trainer

    hf_logging.disable_progress_bar()  # one bar per save/load would drown the run's own output

    from dora.lifetime import mark_ready

    trainer_cls = Trainer
    if config.emulate.trainer:  # modelled compute instead of the model's (dora/emulated)
        from dora.learn.emulated_trainer import EmulatedTrainer

        trainer_cls = EmulatedTrainer
    trainer = trainer_cls(config, run_dir=run_dir, address=address, resume=args.resume)
    mark_ready()  # its model and optimizer are loaded: a failure from now on is worth a restart
    settle_heap()
    return trainer.run()
