"""Config errors for people, for any tree of msgspec Structs: an unknown key names its path and
suggests the nearest valid key; a wrong value names the key, the value and the expected type (the
choices of a `Literal`); NaN and infinities are refused everywhere.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from typing import Annotated, Literal, get_args, get_origin, get_type_hints

import msgspec

from dora.errors import ConfigError

__all__ = ["check_finite", "check_keys", "explain", "struct_type"]


def check_keys(raw: Mapping[str, object], struct: type, *, prefix: str) -> None:
    """Unknown keys are errors that name the key path and suggest the nearest valid key."""
    fields = {f.name: f.type for f in msgspec.structs.fields(struct)}
    hints = get_type_hints(struct, include_extras=True)
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {prefix}{near[0]}?" if near else ""
            valid = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {path!r}{hint} (valid keys here: {valid})")
        sub = struct_type(hints[key])
        if sub is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{path} is a section: expected a table, got {value!r}")
            check_keys(value, sub, prefix=f"{path}.")


def struct_type(tp: object) -> type | None:
    """The msgspec Struct an annotation names (through `Annotated`), or None."""
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    return None


def explain(exc: msgspec.ValidationError, raw: Mapping[str, object], root: type) -> str:
    """Turn msgspec's `Expected ... - at `$.learn.lr`` into a message naming key, value, type."""
    message = str(exc)
    text, _, where = message.rpartition(" - at ")
    if not text:
        return f"invalid config: {message}"
    path = where.strip("`").removeprefix("$.").removeprefix("$")
    value = _value_at(raw, path)
    expected = f"{text[0].lower()}{text[1:]}"
    choices = _literal_choices(path, root)
    if choices:
        expected = f"expected one of {', '.join(repr(c) for c in choices)}"
    if isinstance(value, float) and not math.isfinite(value):
        expected += " (NaN and infinities are never valid settings)"
    return f"{path} = {value!r} is invalid: {expected}"


def _value_at(raw: Mapping[str, object], path: str) -> object:
    """The raw value at a msgspec error path such as `data.eval_kwargs.n` or `a.b[2].c`."""
    value: object = raw
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("[") and isinstance(value, list):
            index = int(part[1:-1])
            value = value[index] if index < len(value) else "<missing>"
        elif isinstance(value, Mapping):
            value = value.get(part, "<missing>")
        else:
            return "<missing>"
    return value


def _literal_choices(path: str, root: type) -> tuple[object, ...]:
    struct: type | None = root
    tp: object = None
    for part in path.split("."):
        if struct is None:
            return ()
        hints = get_type_hints(struct, include_extras=True)
        if part not in hints:
            return ()
        tp = hints[part]
        struct = struct_type(tp)
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return get_args(tp) if get_origin(tp) is Literal else ()


def check_finite(struct: msgspec.Struct, *, prefix: str) -> None:
    """No setting may be NaN or infinite: `learn.lr = inf` would train NaN weights, and a deadline
    of `inf` is a wait forever (every network wait has a deadline)."""
    for name in struct.__struct_fields__:
        value = getattr(struct, name)
        if isinstance(value, msgspec.Struct):
            check_finite(value, prefix=f"{prefix}{name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(
                f"{prefix}{name} = {value!r} is invalid: expected a finite number "
                "(NaN and infinities are never valid settings)"
            )
