"""The config as text: TOML that `load_config` reads back (`dora config show`, the copy in every run
directory, the trackers' record of a run), the generated reference docs/config.md, and the notes a
run prints at start when its config leaves out a section.

Both are derived from the Structs of `dora.config` and their `msgspec.Meta` (types, bounds, one-line
descriptions), so the docs cannot drift from the code: a test regenerates docs/config.md and fails
if the file differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args, get_origin, get_type_hints

import msgspec

from dora.config import DoraConfig, EnvConfig
from dora.config_check import struct_type
from dora.config_rules import CROSS_FIELD_RULES, SAFE_ON_RESUME

__all__ = ["config_markdown", "default_sections", "field_docs", "render_toml", "to_toml_dict"]


def to_toml_dict(config: DoraConfig) -> dict[str, object]:
    """The config as plain data, in section order (for `dora config show` and run directories)."""
    data = msgspec.to_builtins(config)
    assert isinstance(data, dict)
    return data


def render_toml(config: DoraConfig) -> str:
    """Render a resolved config as TOML text that `load_config` reads back unchanged."""
    lines: list[str] = []
    for section, values in to_toml_dict(config).items():
        lines.append(f"[{section}]")
        assert isinstance(values, dict)
        tables: list[tuple[str, dict[str, object]]] = []
        for key, value in values.items():
            if isinstance(value, dict):
                tables.append((key, value))
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        for key, table in tables:
            lines.append(f"[{section}.{key}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in table.items())
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def field_docs() -> list[tuple[str, str, str, str]]:
    """(key path, type, default, description) for every setting, in declaration order."""
    rows: list[tuple[str, str, str, str]] = []
    defaults = to_toml_dict(DoraConfig())
    for section in msgspec.structs.fields(DoraConfig):
        struct = struct_type(section.type)
        assert struct is not None
        section_defaults = defaults[section.name]
        assert isinstance(section_defaults, dict)
        rows += _struct_docs(struct, section.name, section_defaults)
    return rows


def _struct_docs(
    struct: type, prefix: str, defaults: Mapping[str, object]
) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    hints = get_type_hints(struct, include_extras=True)
    for field in msgspec.structs.fields(struct):
        sub = struct_type(hints[field.name])
        if sub is not None:  # a table inside the section: `model.lora.rank`
            sub_defaults = defaults[field.name]
            assert isinstance(sub_defaults, dict)
            rows += _struct_docs(sub, f"{prefix}.{field.name}", sub_defaults)
            continue
        tp, *extras = get_args(hints[field.name])
        meta = next(e for e in extras if isinstance(e, msgspec.Meta))
        bounds = [
            f"{op} {getattr(meta, name)}"
            for name, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
            if getattr(meta, name) is not None
        ]
        type_name = _type_name(tp) + (f" ({', '.join(bounds)})" if bounds else "")
        default = _toml_value(defaults[field.name])
        rows.append((f"{prefix}.{field.name}", type_name, default, meta.description or ""))
    return rows


def _type_name(tp: object) -> str:
    if get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) is not None:
        return str(tp).replace("typing.", "").replace("|", "or")
    return getattr(tp, "__name__", None) or str(tp)


def _resume_markdown() -> list[str]:
    safe = ", ".join(f"`{key}" + (".*" if "." not in key else "") + "`" for key in SAFE_ON_RESUME)
    return [
        "## What a resume may change",
        "",
        "`dora run --resume` (and `dora serve --resume` started on its own) compares the config",
        "with the run directory's `config.toml` (written owner-only,",
        "without `serve.token`, when the run starts) before it starts anything and refuses a",
        "change to any setting that defines the run, naming each",
        "key (old -> new): the model, the rollout (`G`, `B`, `K`, mode, sampling, episode limits,",
        "error policy), the loss and optimiser, `learn.steps` (the last steps' deadlines depend on",
        "it), the environment, the training data and the emulation. These may change:",
        f"{safe}.",
        "They say how the run is served, supervised, logged and evaluated, and how fast the",
        "trainer computes, never what it trains on or how.",
    ]


def config_markdown() -> str:
    """docs/config.md, generated from the Structs (a test fails if the file drifts)."""
    out = [
        "# Configuration reference",
        "",
        "Generated from `dora/config.py` by `dora config docs`; do not edit by hand.",
        "Set any key in the config file's section, or on the command line as `section.key=value`",
        "(`dora run examples/math/config.toml learn.lr=1e-6 rollout.staleness=2`).",
        "`rollout.mode = sync` forces `rollout.staleness = 0`; `one_step_off` forces 1.",
        "",
        "Paths and modules. A relative path (`model.path`, a `data.source` file, `log.run_dir`)",
        "is taken from the working directory dora runs in, not from the config file's folder.",
        "The modules named by `env.cls` and `data.source` (`module:Name`) are imported from the",
        "working directory first (the `dora` command puts it on `sys.path`, as `python -m`",
        "does), then from `PYTHONPATH` and the installed packages; `dora run` starts both sides",
        "in that same working directory. An existing Hugging Face model folder is used as it is",
        "(`model.path`, `model.warmup_steps = 0`); its tokenizer needs a chat template only for",
        "chat prompts.",
        "",
        "The optimiser is AdamW (`learn.lr`, `learn.weight_decay`, torch's betas 0.9 and 0.999",
        "and eps 1e-8) at a constant learning rate, gradients clipped to `learn.grad_clip`.",
        "`learn.lr` defaults to 1e-6 when every weight trains and 1e-5 with LoRA, as peers",
        "do for GRPO (why: [trainer.md](trainer.md#learning-rate-learnlr)).",
        "`learn.max_minutes` ends the run at the first step boundary after the budget, on the",
        "clock of `rollout.jsonl`'s `time_s` (seconds since `dora serve` started its rollout).",
        "",
    ]
    current = ""
    for key, type_name, default, description in field_docs():
        section = key.split(".")[0]
        if section != current:
            current = section
            out += [
                f"## `[{section}]`",
                "",
                "| key | type | default | meaning |",
                "|---|---|---|---|",
            ]
        out.append(f"| `{key}` | {type_name} | `{default}` | {description} |")
    out += ["", "## Rules across settings", "", "Checked at load, after the mode presets:", ""]
    out += [f"- {rule.text}" for rule in CROSS_FIELD_RULES]
    out += ["", *_resume_markdown(), ""]
    return "\n".join(out).replace("|\n## ", "|\n\n## ")


def default_sections(raw: Mapping[str, object]) -> list[str]:
    """Sentences naming what a run trains when its config as written (`raw_config`: the file's
    sections with the command's overrides) leaves out `[model]` or `[env]`: dora's own tiny model
    and chain arithmetic, which a user who forgot a section should hear about at start rather
    than discover in the results."""
    notes = []
    if "model" not in raw:
        notes.append(
            "no [model] section: training dora's tiny character model, built from scratch "
            "(model.path = 'tiny')"
        )
    if "env" not in raw:
        notes.append(
            "no [env] section: the environment is chain arithmetic "
            f"(env.cls = {EnvConfig().cls!r}; set it to 'module:Class' of yours)"
        )
    return notes
