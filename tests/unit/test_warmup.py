"""The supervised warm-up lowers the loss on reference answers, and the prepared model is shared."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.config import load_config
from dora.models.prepare import model_key, prepare_model, source_digest

SMALL = [
    "model.path=tiny",
    "model.tiny_hidden_size=32",
    "model.tiny_layers=1",
    "model.max_model_len=256",
    "model.warmup_steps=2",
    "model.warmup_batch_size=8",
    "data.source=envs.math:chain_arithmetic_tasks",
    "data.kwargs.n=200",
    "data.kwargs.max_terms=3",
]


def test_warmup_learns_and_prepared_model_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DORA_CACHE", str(tmp_path))
    config = load_config(None, SMALL)
    losses: list[float] = []

    from dora.data import load_tasks
    from dora.env import load_env
    from dora.models import TinyModelSpec, build_tiny_model
    from dora.models.warmup import WarmupSettings, warmup

    base = build_tiny_model(tmp_path / "base", TinyModelSpec(hidden_size=32, num_layers=1))
    warmup(
        base,
        tmp_path / "warm",
        tasks=load_tasks("envs.math:chain_arithmetic_tasks", kwargs={"n": 200, "max_terms": 3}),
        env_factory=load_env("envs.math:ChainArithmeticEnv"),
        settings=WarmupSettings(steps=40, batch_size=8, lr=3e-3, max_len=256, threads=1),
        progress=lambda step, loss: losses.append(loss),
    )
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses

    first = prepare_model(config, log=False)
    assert (first / "config.json").is_file() and first.parent == tmp_path / "models"
    assert prepare_model(config, log=False) == first  # cached: the other side finds it ready
    reseeded = load_config(None, [*SMALL, "model.seed=1"])
    assert model_key(reseeded) != model_key(config)


def test_lora_settings_do_not_change_the_initial_model() -> None:
    """A LoRA run trains adapters on the same warmed-up base: its settings must not send it to
    warm up a model of its own (minutes on a CPU for the math example)."""
    config = load_config(None, SMALL)
    lora = load_config(None, [*SMALL, "model.lora.rank=8", "model.lora.alpha=32"])
    assert model_key(lora) == model_key(config)


def test_a_user_model_without_warmup_is_used_as_is(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")  # a model folder; prepare_model reads no weights
    config = load_config(None, [f"model.path={mine}"])
    assert prepare_model(config, log=False) == mine


def test_the_cache_key_covers_the_environment_code_and_the_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "keyed_env.py"
    module.write_text("from envs.math import ChainArithmeticEnv as Env\n")
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["env.cls=keyed_env:Env", f"data.source={data}"])
    key = model_key(config)
    assert model_key(config) == key  # stable
    module.write_text("from envs.math import ChainArithmeticEnv as Env  # a new prompt format\n")
    edited = model_key(config)
    assert edited != key
    data.write_text('{"prompt": "1+2", "answer": "3"}\n')
    assert model_key(config) not in (key, edited)
    assert source_digest("no_such_module_here:Env") == "" == source_digest("")


def test_the_cache_key_covers_the_modules_beside_the_environment_in_its_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`envs.math`'s `__init__` only re-exports: the prompt format lives in a sibling module."""
    package = tmp_path / "keyed_pkg"
    (package / "prompts").mkdir(parents=True)
    (package / "__init__.py").write_text("from keyed_pkg.env import Env\n")
    (package / "env.py").write_text("from envs.math import ChainArithmeticEnv as Env\n")
    (package / "prompts" / "__init__.py").write_text("FORMAT = 'Q: {q}'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["env.cls=keyed_pkg:Env"])
    keys = [model_key(config)]
    (package / "env.py").write_text("from envs.math import ChainArithmeticEnv as Env  # edited\n")
    keys.append(model_key(config))
    (package / "prompts" / "__init__.py").write_text("FORMAT = 'Question: {q}'\n")
    keys.append(model_key(config))
    (package / "prompts" / "__init__.py").rename(package / "prompts" / "formats.py")
    keys.append(model_key(config))
    assert len(set(keys)) == 4
    # an editor's lock file (a dangling link) and a hidden folder neither break nor change it
    (package / ".#env.py").symlink_to("user@host.1234")
    (package / ".backup").mkdir()
    (package / ".backup" / "env.py").write_text("old = 1\n")
    assert model_key(config) == keys[-1]
