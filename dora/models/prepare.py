"""The initial policy of a run: a Hugging Face folder, built and warmed up once, shared by both
sides.

`model.path = "tiny"` builds the tiny character-level model; `model.warmup_steps > 0` then
fine-tunes it (or any other model) on the tasks' reference answers (see `dora.models.warmup`). Serve
and learn must start from the same weights, so the result is cached under a key of everything that
shapes it (model settings, environment, task source, seeds, and the source of the packages of
the environment and of the task source, or the dataset file, so that editing a prompt format or
regenerating a dataset builds a new model): whichever side comes first builds it under a file lock,
the other finds it ready. `dora run` prepares it before starting either side.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import msgspec

from dora.config import DoraConfig
from dora.models.hub import resolve_model_path


def cache_root() -> Path:
    return Path(os.environ.get("DORA_CACHE", Path.home() / ".cache" / "dora")) / "models"


def model_key(config: DoraConfig) -> str:
    """A digest of every setting, and of the user code and data, that change the initial weights."""
    model = msgspec.to_builtins(config.model)
    model.pop("lora", None)  # adapters train on top of the same initial weights
    shaping = {
        "model": model,
        "env": msgspec.to_builtins(config.env),
        "data": [config.data.source, config.data.kwargs, config.data.seed]
        + ([config.data.split] if config.data.source == "env" else []),
        "code": [source_digest(config.env.cls), source_digest(config.data.source)],
        "version": 2,
    }
    return hashlib.sha256(msgspec.json.encode(shaping)).hexdigest()[:16]


def source_digest(spec: str) -> str:
    """sha256 of what `spec` reads: a dataset file's bytes, or for `"module:Name"` every `.py` file
    of the package that holds the module (`envs.math:Env` reads `envs/math/**/*.py`: a package's
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
            module = importlib.import_module(module_name)
        except ImportError:
            return ""
        files = _package_sources(module)
        if not files:
            return ""
    digest = hashlib.sha256()
    for name, file in files:
        try:
            with open(file, "rb") as f:  # a dataset may be large: read in blocks
                content = hashlib.file_digest(f, "sha256").digest()
        except FileNotFoundError:  # deleted since it was listed
            continue
        digest.update(name.encode() + b"\0" + content)
    return digest.hexdigest()


def _package_sources(module: ModuleType) -> list[tuple[str, Path]]:
    """(name, path) of each `.py` file of the package that holds `module` (itself if it is one),
    sorted; hidden files and folders (an editor's lock files) and dangling links left out."""
    if not hasattr(module, "__path__") and "." in module.__name__:
        module = sys.modules[module.__name__.rpartition(".")[0]]
    roots = [Path(p) for p in getattr(module, "__path__", [])]
    if not roots:
        file = Path(getattr(module, "__file__", None) or "")
        return [(file.name, file)] if file.is_file() else []
    found = [
        (f"{i}/{f.relative_to(root)}", f)
        for i, root in enumerate(roots)
        for f in root.rglob("*.py")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(root).parts)
    ]
    return sorted(found)


def prepare_model(config: DoraConfig, *, log: bool = True) -> Path:
    """The folder of the run's initial weights, building and warming it up if needed."""
    model = config.model
    if model.path != "tiny":
        local = resolve_model_path(model.path)
        assert local is not None  # downloaded, or ConfigError
        config = msgspec.structs.replace(
            config, model=msgspec.structs.replace(model, path=str(local))
        )
        if model.warmup_steps == 0:
            return local
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

    from dora.data import config_tasks
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
        add_special_tokens=config.env.prompt_special_tokens,
    )
    env_factory = load_env(config.env.cls, **config.env.kwargs)
    tasks = config_tasks(config.data, env_factory)
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
