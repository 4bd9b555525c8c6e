"""The config loads, validates and explains itself; docs/config.md cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.config import DoraConfig, load_config
from dora.config_file import raw_config
from dora.config_text import config_markdown, default_sections, render_toml
from dora.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "math" / "config.toml"


def test_example_config_loads_and_overrides_apply() -> None:
    config = load_config(EXAMPLE, ["learn.lr=1e-6", "rollout.staleness=3"])
    assert config.learn.lr == 1e-6
    assert config.rollout.staleness == 3
    assert config.env.cls == "envs.math:ChainArithmeticEnv"


def test_wrong_type_names_key_value_and_expected_type() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, ["learn.lr=abc"])
    message = str(err.value)
    assert "learn.lr" in message and "'abc'" in message and "float" in message


def test_unknown_key_suggests_nearest() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'learn\.lrr'; did you mean learn\.lr\?"):
        load_config(EXAMPLE, ["learn.lrr=1"])


def test_unknown_section_lists_valid_sections() -> None:
    with pytest.raises(ConfigError, match="valid keys here: data, emulate, env, learn"):
        load_config(None, ["trainer.lr=1"])


def test_bounds_and_choices_are_explained() -> None:
    with pytest.raises(ConfigError, match=r"learn\.steps = 0 .*>= 1"):
        load_config(None, ["learn.steps=0"])
    with pytest.raises(ConfigError, match="expected one of 'sync', 'one_step_off'"):
        load_config(None, ["rollout.mode=fast"])


def test_settings_that_can_only_give_nan_are_refused() -> None:
    for key in ("learn.lr", "model.warmup_lr", "serve.request_timeout_s"):
        with pytest.raises(ConfigError, match=rf"{key} = inf is invalid: expected a finite number"):
            load_config(None, [f"{key}=inf"])
        for value in ("-inf", "nan"):
            with pytest.raises(ConfigError, match=rf"{key} = .*NaN and infinities are never"):
                load_config(None, [f"{key}={value}"])
    with pytest.raises(ConfigError, match=r"rollout\.temperature = 1e-45 .*>= 0\.0001"):
        load_config(None, ["rollout.temperature=1e-45"])
    assert load_config(None, ["rollout.temperature=0.0001"]).rollout.temperature == 1e-4


def test_a_bad_value_inside_a_list_names_its_index_and_value() -> None:
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules\[1\] = 3 is invalid"):
        load_config(None, ['model.lora.target_modules=["q_proj", 3]'])
    with pytest.raises(ConfigError, match=r"serve\.vllm_devices\[0\] = 1 is invalid"):
        load_config(None, ["serve.vllm_devices=[1]"])


def test_modes_are_presets_of_staleness() -> None:
    assert load_config(EXAMPLE, ["rollout.mode=sync"]).rollout.staleness == 0
    assert load_config(EXAMPLE, ["rollout.mode=one_step_off"]).rollout.staleness == 1
    assert load_config(EXAMPLE, ["rollout.mode=dora", "rollout.staleness=4"]).rollout.staleness == 4


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match=r"group_size = 16 .* serve\.max_running = 8"):
        load_config(None, ["rollout.group_size=16", "serve.max_running=8"])
    with pytest.raises(ConfigError, match="updates_per_step"):
        load_config(None, ["rollout.batch_size=2", "learn.updates_per_step=3"])
    with pytest.raises(ConfigError, match=r"serve\.token"):
        load_config(None, ["serve.host=0.0.0.0"])
    assert load_config(None, ["serve.host=0.0.0.0", "serve.token=s3cret"]).serve.token == "s3cret"


def test_yaml_and_toml_agree(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("learn:\n  lr: 0.001\nrollout:\n  group_size: 4\n")
    toml_file = tmp_path / "c.toml"
    toml_file.write_text("[learn]\nlr = 0.001\n[rollout]\ngroup_size = 4\n")
    assert load_config(yaml_file) == load_config(toml_file)


def test_bad_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[learn\nlr = 1")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_rendered_config_reads_back_unchanged(tmp_path: Path) -> None:
    config = load_config(EXAMPLE, ["env.kwargs.max_terms=9", "serve.urls=['http://a:1']"])
    out = tmp_path / "resolved.toml"
    out.write_text(render_toml(config))
    assert load_config(out) == config


def test_every_field_is_documented_and_docs_are_current() -> None:
    text = config_markdown()
    for section in DoraConfig.__struct_fields__:
        assert f"## `[{section}]`" in text
    assert "|  |" not in text, "a field lacks its description"
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == text, (
        "docs/config.md is stale: run `dora config docs --write docs/config.md`"
    )


def test_a_config_without_model_or_env_says_what_it_trains_on(tmp_path: Path) -> None:
    assert default_sections(raw_config(EXAMPLE)) == []
    bare = tmp_path / "bare.toml"
    bare.write_text("[learn]\nsteps = 3\n")
    raw = raw_config(bare)
    bare.unlink()  # the notes come from the config already read, not from the file again
    notes = default_sections(raw)
    assert len(notes) == 2
    assert "no [model] section" in notes[0] and "'tiny'" in notes[0]
    assert "no [env] section" in notes[1] and "envs.math:ChainArithmeticEnv" in notes[1]
    assert default_sections({**raw, **raw_config(None, ["model.path=/m", "env.cls=my:Env"])}) == []


def test_the_default_learning_rate_is_the_peers_one_and_ten_times_it_for_lora() -> None:
    assert load_config(None).learn.lr == 1e-6  # TRL's GRPOConfig, verl, prime-rl: full weights
    assert load_config(None, ["model.lora.rank=8"]).learn.lr == 1e-5
    given = load_config(None, ["model.lora.rank=8", "learn.lr=3e-5"])
    assert given.learn.lr == 3e-5  # a rate the config gives is kept, LoRA or not
    assert load_config(None, ["learn.lr=2e-6"]).learn.lr == 2e-6


def test_inflight_mode_is_refused_with_vllm_naming_the_keys() -> None:
    with pytest.raises(
        ConfigError, match=r"rollout\.mode = 'inflight' is invalid with serve\.backend = 'vllm'"
    ):
        load_config(None, ["rollout.mode=inflight", "serve.backend=vllm"])
    config = load_config(None, ["rollout.mode=inflight", "rollout.staleness=3"])
    assert (config.rollout.mode, config.rollout.staleness) == ("inflight", 3)
