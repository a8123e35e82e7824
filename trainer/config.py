"""Recipes: nested dataclasses in code, YAML at the edge, `key=value` overrides on the command line.

A key that no dataclass field reads is an error naming the key and the keys that exist there; so is a value of
the wrong type. Every field documents itself through `opt(default, help)`, which `describe()` prints for `--help`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import yaml

from expertcache.telemetry.errors import InputError


class RecipeError(InputError):
    """A recipe or override that does not fit the recipe's dataclasses."""


def opt(default, help: str):
    """A dataclass field with a default and a one-line help text (shown by `--help`)."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata={"help": help})
    if dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda d=default: dataclasses.replace(d), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _coerce(value, tp, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except RecipeError as e:
                errors.append(str(e))
        raise RecipeError(errors[0] if errors else f"{where}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: expected a mapping of {tp.__name__} keys, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (typing.Any,)
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is typing.Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise RecipeError(f"{where}: expected true/false, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise RecipeError(f"{where}: expected a number, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecipeError(f"{where}: expected an integer, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise RecipeError(f"{where}: expected a string, got {value!r}")
    return value


def from_dict(cls, data: dict, where: str = ""):
    """Build dataclass `cls` from `data`, rejecting keys that no field reads."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        path = f"{where}." if where else ""
        raise RecipeError(f"unknown recipe key {path}{unknown[0]!s}; keys at {where or 'the top level'} are: "
                          f"{', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`a.b=value` pairs onto a nested dict; values are parsed as YAML scalars (`3`, `1e-3`, `true`, `[1,2]`)."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not of the form key=value (e.g. train.max_steps=100)")
        key, raw = item.split("=", 1)
        value = _yaml(raw, f"override {key!r}") if raw != "" else ""
        if not key or any(not p for p in key.split(".")):
            raise RecipeError(f"override {item[:60]!r}: empty key name (expected e.g. train.max_steps=100)")
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {key!r}: {p!r} is not a section")
        node[parts[-1]] = value
    return data


def _yaml(text: str, where: str):
    """`yaml.safe_load`, its errors as one-line `RecipeError`s."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        why = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"{where}: not valid YAML{at}: {why}") from None
    except RecursionError:
        raise RecipeError(f"{where}: YAML nested too deeply") from None


def load_recipe(cls, path: str | Path | None, overrides: list[str] = ()):
    """Defaults of `cls`, then the YAML at `path` (if any), then `overrides`; every key checked."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe {path} not found")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise RecipeError(f"recipe {path} is not UTF-8 text (byte {e.start})") from None
        loaded = _yaml(text, f"recipe {path}")
        if loaded is not None and not isinstance(loaded, dict):
            raise RecipeError(f"recipe {path} must be a mapping of keys, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, list(overrides))
    return from_dict(cls, data)


def describe(cls, prefix: str = "") -> list[str]:
    """One line per key: `section.key (type, default): help`."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            lines.append(f"{name}: {f.metadata.get('help', '')}")
            lines.extend(describe(tp, name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")
        tname = getattr(tp, "__name__", str(tp).replace("typing.", ""))
        lines.append(f"  {name} ({tname}, default {default!r}): {f.metadata.get('help', '')}")
    return lines
