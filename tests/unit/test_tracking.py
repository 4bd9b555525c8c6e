"""TensorBoard and W&B logging (dora/tracking.py) through serve's metrics log.

TensorBoard is tested with the real writer (tensorboard is in the dev extra) and read back with
TensorBoard's own event reader. W&B is tested with a fake `wandb` module put into `sys.modules`:
the real package needs an account or its offline service process, which is too heavy for the dev
install; the fake records the calls dora makes (init, define_metric, log, summary, finish).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import msgspec
import pytest

from dora.config import load_config
from dora.errors import ConfigError
from dora.records import Record, Trained, WeightLoad
from dora.serve.metrics import MetricsLog
from dora.tracking import open_tracking, scalars

TICK = {
    "step": 3,
    "trained": 2,
    "instances": [
        {"id": "i0", "version": 3, "ready": True, "util": 0.5},
        {"id": "i1", "version": 2, "ready": False, "util": 0.25},
    ],
    "serving_versions": {"2": 1, "3": 4},
    "staleness_histogram": [5, 2],
    "weights_held": [2, 3],
    "admission_wait_s": {"instance_full": 0.75},
    "loop_lag_ms": 1.5,
}
TRAINED = {"step": 2, "metrics": {"loss": 0.125, "reward_mean": 0.5, "tokens": 900.0}}


def record(kind: str, fields: dict[str, object]) -> Record:
    """A record of `kind` with only `fields` (the tracking sink reads whatever a record holds)."""
    cls = msgspec.defstruct(
        f"Fake_{kind}", [(k, object) for k in fields], bases=(Record,), tag=kind, kw_only=True
    )
    out: Record = cls(**fields)
    return out


def _write_run(log: MetricsLog) -> None:
    log.write(record("tick", TICK))
    log.write(record("step", {"step": 2, "fill_s": 1.25, "versions": [1, 2], "staleness": [1, 0]}))
    log.write(Trained(step=2, metrics=TRAINED["metrics"]))  # type: ignore[arg-type]
    log.write(Trained(step=3, metrics={"loss": 0.25, "reward_mean": 0.75}))
    log.write(record("eval", {"step": 4, "version": 4, "accuracy": 0.375, "n": 128}))
    log.write(WeightLoad(instance="i0", version=3, seconds=0.1))
    log.write(record("summary", {"mode": "dora", "steps": 4, "wall_s": 12.5}))
    log.close()


def test_scalars_flatten_numbers_and_instances() -> None:
    values = scalars({"kind": "tick", **TICK}, "serve", skip=frozenset({"kind"}))
    assert values == {
        "serve/step": 3.0,
        "serve/trained": 2.0,
        "serve/instances/i0/version": 3.0,
        "serve/instances/i0/ready": 1.0,
        "serve/instances/i0/util": 0.5,
        "serve/instances/i1/version": 2.0,
        "serve/instances/i1/ready": 0.0,
        "serve/instances/i1/util": 0.25,
        "serve/serving_versions/2": 1.0,
        "serve/serving_versions/3": 4.0,
        "serve/admission_wait_s/instance_full": 0.75,
        "serve/loop_lag_ms": 1.5,
    }
    assert scalars({"x": float("nan"), "y": "text", "z": [1, 2]}, "p") == {}


def test_off_by_default_imports_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # with both packages unimportable, the default config still works: nothing is imported
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "trackio", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert open_tracking(load_config(None), tmp_path) is None


@pytest.mark.parametrize(
    ("key", "module", "package"),
    [
        ("log.tensorboard", "torch.utils.tensorboard", "tensorboard"),
        ("log.wandb", "wandb", "wandb"),
        ("log.trackio", "trackio", "trackio"),
    ],
)
def test_switched_on_without_the_package_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, key: str, module: str, package: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    config = load_config(None, [f"{key}=true"])
    with pytest.raises(ConfigError, match=rf"{key} = true needs the {package} package.*install"):
        open_tracking(config, tmp_path)


def test_tensorboard_gets_serve_learn_and_eval_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = load_config(None, ["log.tensorboard=true"])
    _write_run(MetricsLog(tmp_path, tracking=open_tracking(config, tmp_path)))

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "serve/instances/i1/util",
        "serve/step",
        "learn/loss",
        "learn/tokens",
        "eval/accuracy",
        "rollout/fill_s",
    } <= tags
    assert not any(t.startswith(("summary/", "weight_load")) for t in tags)
    loss = [(e.step, e.value) for e in events.Scalars("learn/loss")]
    assert loss == [(2, 0.125), (3, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(4, 0.375)]
    (util,) = events.Scalars("serve/instances/i1/util")
    assert util.value == 0.25 and util.step >= 0  # ticks: milliseconds since serve started
    # the JSONL log is written as before
    lines = (tmp_path / "rollout.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["kind"] for line in lines]
    assert kinds == ["tick", "step", "trained", "trained", "eval", "weight_load", "summary"]


class _FakeRun:
    def __init__(self) -> None:
        self.defined: dict[str, str | None] = {}
        self.logged: list[dict[str, float]] = []
        self.summary: dict[str, float] = {}
        self.finished = False

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.defined[name] = step_metric

    def log(self, data: dict[str, float]) -> None:
        self.logged.append(data)

    def finish(self) -> None:
        self.finished = True


def test_wandb_one_run_with_an_axis_per_stream(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run = _FakeRun()
    inits: list[dict[str, object]] = []

    def init(**kwargs: object) -> _FakeRun:
        inits.append(kwargs)
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    config = load_config(None, ["log.wandb=true", "log.name=bench", "learn.lr=0.001"])
    _write_run(MetricsLog(tmp_path, tracking=open_tracking(config, tmp_path)))

    (kwargs,) = inits
    assert kwargs["project"] == "dora" and kwargs["name"] == "bench"
    assert kwargs["dir"] == str(tmp_path)
    assert isinstance(kwargs["config"], dict) and kwargs["config"]["learn"]["lr"] == 0.001
    assert run.defined["learn/*"] == "learn/step"
    assert run.defined["serve/*"] == "serve/time_ms"
    assert run.defined["eval/*"] == "eval/step"
    learn = [d for d in run.logged if "learn/step" in d]
    assert learn == [
        {"learn/loss": 0.125, "learn/reward_mean": 0.5, "learn/tokens": 900.0, "learn/step": 2},
        {"learn/loss": 0.25, "learn/reward_mean": 0.75, "learn/step": 3},
    ]
    (tick,) = [d for d in run.logged if "serve/time_ms" in d]
    assert tick["serve/instances/i0/util"] == 0.5 and tick["serve/step"] == 3.0
    assert {"eval/accuracy": 0.375, "eval/version": 4.0, "eval/n": 128.0, "eval/step": 4} in (
        run.logged
    )
    assert run.summary == {"summary/steps": 4.0, "summary/wall_s": 12.5}
    assert run.finished


class _FakeTrackioRun:
    def __init__(self) -> None:
        self.logged: list[tuple[int | None, dict[str, float]]] = []
        self.finished = False

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, metrics))

    def finish(self) -> None:
        self.finished = True


def test_trackio_one_run_every_stream_at_the_train_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run = _FakeTrackioRun()
    inits: list[dict[str, object]] = []

    def init(**kwargs: object) -> _FakeTrackioRun:
        inits.append(kwargs)
        return run

    monkeypatch.setitem(sys.modules, "trackio", types.SimpleNamespace(init=init))
    config = load_config(None, ["log.trackio=true", "log.name=bench", "learn.lr=0.001"])
    _write_run(MetricsLog(tmp_path, tracking=open_tracking(config, tmp_path)))

    (kwargs,) = inits
    assert kwargs["project"] == "dora" and kwargs["name"] == "bench"
    assert isinstance(kwargs["config"], dict) and kwargs["config"]["learn"]["lr"] == 0.001
    steps = [step for step, _ in run.logged]
    assert steps == sorted(steps), "trackio's one axis never goes back"
    (tick_step, tick), *_ = run.logged  # before any step is trained: step 0, its clock beside
    assert tick_step == 0 and tick["serve/instances/i0/util"] == 0.5 and "serve/time_ms" in tick
    assert (2, {"learn/loss": 0.125, "learn/reward_mean": 0.5, "learn/tokens": 900.0}) in (
        run.logged
    )
    assert (4, {"eval/accuracy": 0.375, "eval/version": 4.0, "eval/n": 128.0}) in run.logged
    assert run.logged[-1] == (4, {"summary/steps": 4.0, "summary/wall_s": 12.5})
    assert run.finished
