"""The initial policy of a run: a Hugging Face folder, built and warmed up once, shared by both
sides.

`model.path = "tiny"` builds the tiny character-level model; `model.warmup_steps > 0` then
fine-tunes it (or any other model) on the tasks' reference answers (see `dora.models.warmup`). Serve
and learn must start from the same weights, so the result is cached under a key of everything that
shapes it (model settings, environment, task source, seeds, and the source of the environment's
package and of the task source's package or dataset file, so that editing a prompt format or
regenerating a dataset builds a new model): whichever side comes first builds it under a file lock,
the other finds it ready. `dora run` prepares it before starting either side.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import tempfile
from pathlib import Path

import msgspec

from dora.config import DoraConfig


def cache_root() -> Path:
    return Path(os.environ.get("DORA_CACHE", Path.home() / ".cache" / "dora")) / "models"


def model_key(config: DoraConfig) -> str:
    """A digest of every setting, and of the user code and data, that change the initial weights."""
    shaping = {
        "model": msgspec.to_builtins(config.model),
        "env": msgspec.to_builtins(config.env),
        "data": [config.data.source, config.data.kwargs, config.data.seed],
        "code": [source_digest(config.env.cls), source_digest(config.data.source)],
        "version": 2,
    }
    return hashlib.sha256(msgspec.json.encode(shaping)).hexdigest()[:16]


def source_digest(spec: str) -> str:
    """sha256 of what `spec` reads: a dataset file's bytes, or for `"module:Name"` every `.py` file
    of the module's top-level package (`envs.math:Env` reads `envs/**/*.py`: a package's
    `__init__` often only re-exports, and the code that shapes the prompts lives beside it), or the
    module's own file when it is not in a package. "" when there is none (a spec that does not
    load fails later, with its own error)."""
    path = Path(spec)
    if path.is_file():
        files = [(path.name, path)]
    else:
        module_name, sep, _ = spec.partition(":")
        if not sep or not module_name:
            return ""
        try:
            importlib.import_module(module_name)
        except ImportError:
            return ""
        files = _package_sources(module_name.partition(".")[0])
        if not files:
            return ""
    digest = hashlib.sha256()
    for name, file in files:
        digest.update(name.encode() + b"\0")
        with open(file, "rb") as f:  # a dataset may be large: read in blocks
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def _package_sources(top: str) -> list[tuple[str, Path]]:
    """(path relative to its root, path) of each `.py` file of module `top`, sorted."""
    module = importlib.import_module(top)
    roots = [Path(p) for p in getattr(module, "__path__", [])]
    if not roots:
        file = Path(getattr(module, "__file__", None) or "")
        return [(file.name, file)] if file.is_file() else []
    found = {str(f.relative_to(root)): f for root in roots for f in root.rglob("*.py")}
    return sorted(found.items())


def prepare_model(config: DoraConfig, *, log: bool = True) -> Path:
    """The folder of the run's initial weights, building and warming it up if needed."""
    model = config.model
    if model.path != "tiny" and model.warmup_steps == 0:
        return Path(model.path)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / model_key(config)
    with open(root / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other side waits here while one builds
        if (final / "config.json").is_file():
            return final
        with tempfile.TemporaryDirectory(dir=root) as scratch:
            # always a folder inside scratch: a user's folder without warm-up returned above
            os.replace(_build(config, Path(scratch), log=log), final)
    return final


def _build(config: DoraConfig, scratch: Path, *, log: bool) -> Path:
    from dora.models.tiny import TinyModelSpec, build_tiny_model

    model = config.model
    if model.path == "tiny":
        base = build_tiny_model(
            scratch / "base",
            TinyModelSpec(
                hidden_size=model.tiny_hidden_size,
                num_layers=model.tiny_layers,
                max_position_embeddings=max(model.max_model_len, 64),
                seed=model.seed,
            ),
        )
    else:
        base = Path(model.path)
    if model.warmup_steps == 0:
        return base
    return _warmup(config, base, scratch / "warm", log=log)


def _warmup(config: DoraConfig, base: Path, out: Path, *, log: bool) -> Path:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from dora.data import load_tasks
    from dora.env import load_env
    from dora.models.warmup import WarmupSettings, warmup

    model = config.model
    settings = WarmupSettings(
        steps=model.warmup_steps,
        lr=model.warmup_lr,
        batch_size=model.warmup_batch_size,
        max_len=model.max_model_len,
        seed=model.seed,
        threads=max(1, os.cpu_count() or 1),
    )
    tasks = load_tasks(config.data.source, kwargs=config.data.kwargs, seed=config.data.seed)
    env_factory = load_env(config.env.cls, **config.env.kwargs)
    with Progress(
        TextColumn("warm-up"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
        TimeRemainingColumn(),
        disable=not log,
    ) as bar:
        job = bar.add_task("warm-up", total=settings.steps, loss=float("nan"))
        return warmup(
            base,
            out,
            tasks=tasks,
            env_factory=env_factory,
            settings=settings,
            progress=lambda step, loss: bar.update(job, completed=step + 1, loss=loss),
        )
