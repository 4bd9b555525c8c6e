"""Optional TensorBoard, Weights & Biases and trackio logging of a run's metric records
(`log.tensorboard`, `log.wandb`, `log.trackio`; all off by default).

One sink for both streams: `dora serve`'s `MetricsLog` hands every record it writes to
`rollout.jsonl` to `Tracking.record`, and that log already carries the trainer's metrics (the
`trained` record of each `StepDone`), so one process in one place logs serve and learn together,
whether the trainer runs beside it or on other nodes, and W&B sees one run, not two.

What is logged, as scalars (nested dicts flattened with `/`; lists of dicts with an `id` keyed by
that id, e.g. `serve/instances/i0/util`; strings and other lists left out):

| record | tags | x axis |
| --- | --- | --- |
| `tick` | `serve/...` (utilisation, leases, queue, staleness, waits) | ms since serve started |
| `trained` | `learn/...` (loss, reward, entropy, tokens, step and wait times) | train step |
| `eval` | `eval/...` (held-out accuracy, reward) | train step |
| `step` | `rollout/...` (how long the step took to fill) | train step |
| `summary` | W&B's run summary only | |

TensorBoard writes event files under `<run_dir>/tensorboard` through
`torch.utils.tensorboard.SummaryWriter` (`tensorboard --logdir <run_dir>/tensorboard`). W&B starts
one run named after `log.name`, with the resolved config, in `<run_dir>/wandb`; its mode (online,
offline) comes from W&B's own settings (`WANDB_MODE`, `wandb login`). Each W&B prefix has its own
x axis (`define_metric`), because W&B's global step must only grow and ticks outnumber steps.
trackio (local-first: its runs stay on this machine unless told otherwise) logs every stream at the
train step (`_Trackio`).

Each package is imported only when its switch is on (`pip install -e '.[tracking]'` in dora's
checkout); a switch that is on without its package is a `ConfigError` at start, before any work
is done.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dora.errors import ConfigError

if TYPE_CHECKING:
    from dora.config import DoraConfig

__all__ = ["Tracking", "open_tracking", "scalars"]

Record = Mapping[str, object]

# kind -> (tag prefix, the record key holding its step; None: milliseconds since start)
_HEAD = frozenset({"kind", "time_s"})
_KINDS: dict[str, tuple[str, str | None]] = {
    "tick": ("serve", None),
    "trained": ("learn", "step"),
    "eval": ("eval", "step"),
    "step": ("rollout", "step"),
}


def _axis(prefix: str, step_key: str | None) -> str:
    return f"{prefix}/{'step' if step_key else 'time_ms'}"


class _Sink(Protocol):
    def log(self, values: dict[str, float], *, axis: str, step: int, wall_s: float) -> None: ...

    def summary(self, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars(record: Record, prefix: str, *, skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """The numbers of a record as `prefix/key/...` tags, without the top-level keys in `skip`
    (pure)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key not in skip:
            _flatten(value, f"{prefix}/{key}", out)
    return out


def _flatten(value: object, name: str, out: dict[str, float]) -> None:
    if isinstance(value, bool):
        out[name] = float(value)
    elif isinstance(value, int | float):
        if math.isfinite(value):
            out[name] = float(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(item, f"{name}/{key}", out)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, Mapping) and "id" in item:
                _flatten({k: v for k, v in item.items() if k != "id"}, f"{name}/{item['id']}", out)


class Tracking:
    """Routes metric records to the sinks that are switched on."""

    def __init__(self, sinks: list[_Sink]) -> None:
        self._sinks = sinks
        self._wall0 = time.time()

    def record(self, record: Record) -> None:
        """One record as `MetricsLog` writes it (`kind` and `time_s` first)."""
        kind = str(record.get("kind", ""))
        time_s = record.get("time_s", 0.0)
        assert isinstance(time_s, int | float)
        if kind == "summary":
            values = scalars(record, "summary", skip=_HEAD)
            for sink in self._sinks:
                sink.summary(values)
            return
        if kind not in _KINDS:
            return  # events (weight loads, drains, failures) stay in rollout.jsonl
        prefix, step_key = _KINDS[kind]
        body = record.get("metrics", record) if kind == "trained" else record
        assert isinstance(body, Mapping)
        values = scalars(body, prefix, skip=_HEAD | {step_key or ""})
        if not values:
            return
        raw_step = record.get(step_key) if step_key is not None else None
        step = int(raw_step) if isinstance(raw_step, int | float) else round(1000 * time_s)
        axis = _axis(prefix, step_key)
        for sink in self._sinks:
            sink.log(values, axis=axis, step=step, wall_s=self._wall0 + time_s)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


class _TensorBoard:
    def __init__(self, logdir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch raises this when the tensorboard package is missing
            raise ConfigError(
                "log.tensorboard = true needs the tensorboard package, which is not installed: "
                "pip install -e '.[tracking]' in dora's checkout (or pip install tensorboard), "
                "or set log.tensorboard = false"
            ) from exc
        self._writer = SummaryWriter(log_dir=str(logdir))

    def log(self, values: dict[str, float], *, axis: str, step: int, wall_s: float) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step, walltime=wall_s)

    def summary(self, values: dict[str, float]) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _WandB:
    def __init__(self, config: DoraConfig, run_dir: Path) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(
                "log.wandb = true needs the wandb package, which is not installed: "
                "pip install -e '.[tracking]' in dora's checkout (or pip install wandb), "
                "or set log.wandb = false"
            ) from exc
        from dora.config_text import to_toml_dict

        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(
            project="dora",
            name=config.log.name,
            dir=str(run_dir),
            config=to_toml_dict(config),
        )
        for prefix, step_key in _KINDS.values():
            axis = _axis(prefix, step_key)
            self._run.define_metric(axis)
            self._run.define_metric(f"{prefix}/*", step_metric=axis)

    def log(self, values: dict[str, float], *, axis: str, step: int, wall_s: float) -> None:
        self._run.log({**values, axis: step})

    def summary(self, values: dict[str, float]) -> None:
        self._run.summary.update(values)

    def close(self) -> None:
        self._run.finish()


class _Trackio:
    """trackio (local-first, W&B-like): one run in project `dora`, stored where trackio's own
    settings say (`TRACKIO_DIR`; `trackio show` opens its dashboard). trackio has one step axis
    per run, so every stream is logged at the train step: a tick at the newest step trained so
    far, with its own clock (`serve/time_ms`) as a value beside the others."""

    def __init__(self, config: DoraConfig) -> None:
        try:
            import trackio
        except ImportError as exc:
            raise ConfigError(
                "log.trackio = true needs the trackio package, which is not installed: "
                "pip install trackio, or set log.trackio = false"
            ) from exc
        from dora.config_text import to_toml_dict

        self._trackio = trackio
        self._run = trackio.init(project="dora", name=config.log.name, config=to_toml_dict(config))
        self._step = 0

    def log(self, values: dict[str, float], *, axis: str, step: int, wall_s: float) -> None:
        if axis.endswith("/step"):
            self._step = max(self._step, step)
            self._run.log(values, step=step)
        else:
            self._run.log({**values, axis: float(step)}, step=self._step)

    def summary(self, values: dict[str, float]) -> None:
        self._run.log(values, step=self._step)

    def close(self) -> None:
        self._run.finish()


def open_tracking(config: DoraConfig, run_dir: Path) -> Tracking | None:
    """The sinks `config.log` switches on, or None when all are off (nothing is imported)."""
    sinks: list[_Sink] = []
    try:
        if config.log.tensorboard:
            sinks.append(_TensorBoard(run_dir / "tensorboard"))
        if config.log.wandb:
            sinks.append(_WandB(config, run_dir))
        if config.log.trackio:
            sinks.append(_Trackio(config))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return Tracking(sinks) if sinks else None
