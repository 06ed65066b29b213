"""Typed settings from YAML, with ``key=value`` overrides, errors that name file, line and key.

Why not a bigger config framework: a recipe's settings are a dataclass (typed, documented, with
defaults); this module reads a YAML file into it (PyYAML's safe loader, keeping each key's line),
applies command-line overrides with dotted keys, and rejects unknown keys and wrong types with the
line to fix and the nearest known key. No code is executed from config files.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, TypeVar, Union

import yaml

from multigpu.config.yaml_file import Lines, load_yaml, parse_yaml
from multigpu.errors import ConfigError, shown
from multigpu.validate import MAX_ITEMS, MAX_TEXT

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # config classes are dataclasses


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["trainer.epochs=3", "lr=1e-3"]`` -> ``{"trainer.epochs": 3, "lr": 0.001}`` (YAML-typed values)."""
    out: dict[str, Any] = {}
    for item in items:
        _hydra_habit(item)
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise ConfigError(
                f"override {shown(item, 60)} is not KEY=VALUE.",
                "write e.g. trainer.epochs=3 (dotted for nested keys).",
            )
        try:
            value = parse_yaml(raw, f"override {key}")[0] if raw.strip() else ""
        except ConfigError as exc:
            if "invalid YAML" not in exc.message:
                raise  # a bomb or a duplicate key is refused, not passed on as text
            value = raw
        out[key] = value
    return out


def format_value(value: Any) -> str:
    """A YAML scalar :func:`parse_overrides` reads back as the same value: a string YAML would read
    as something else (``"off"`` a boolean, ``"1e-3"`` or ``"007"`` a number, ``"null"`` nothing) is quoted."""
    if isinstance(value, str):
        try:
            if isinstance(yaml.safe_load(value), str) and yaml.safe_load(value) == value:
                return value
        except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError):
            pass  # a text YAML reads as a bad date or number ("2020-13-45"): quoted below
    text: str = yaml.safe_dump(value, default_flow_style=True, width=2**31 - 1)
    return text.strip().removesuffix("...").strip()


def _hydra_habit(item: str) -> None:
    """Hydra's spellings, which say something else here: one line naming what does."""
    if item in ("--multirun", "-m"):
        raise ConfigError(
            f"{item} is Hydra's sweep switch; a recipe's overrides here are one run's.",
            "sweep with the queue: `multigpu queue runs.yaml --sweep 'optim.lr=1e-3,3e-3'` (a runs file's "
            "entry names the script), or list the runs in a runs file.",
        )
    if item.startswith("+") and "=" in item:
        raise ConfigError(
            f"override {shown(item, 60)}: Hydra's + adds a key; here every key the recipe has is set "
            "as KEY=VALUE, and one it does not have is an error.",
            f"write {shown(item.lstrip('+'), 60)} (without the +).",
        )
    if item.startswith("~"):
        raise ConfigError(
            f"override {shown(item, 60)}: Hydra's ~ deletes a key; a recipe's key here always has a "
            "value.",
            "leave the override out to keep the file's value, or give the key its default.",
        )


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                f"override {dotted}: {part!r} is a value, not a group of keys.",
                f"use {'.'.join(parts[:-1])}=VALUE.",
            )
        node = child
    node[parts[-1]] = value


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: nested mappings merge key by key, everything else is replaced."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------- typed conversion


def where(source: str, lines: Lines, path: tuple[str, ...]) -> str:
    """``file:line`` of a key, or where else it came from (a command-line override), else the source."""
    line = lines.get(path)
    if isinstance(line, str):
        return line
    return f"{source}:{line}" if line else source


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, source: str, lines: Lines, path: tuple[str, ...]) -> Any:
    key = ".".join(path)
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, source, lines, path)
            except ConfigError as exc:
                errors.append(exc)
        raise (
            errors[0]
            if errors
            else ConfigError(
                f"{where(source, lines, path)}: {key} cannot be null.", "give a value."
            )
        )
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{where(source, lines, path)}: {key} must be a group of keys, not {value!r}.",
                f"indent its settings under `{path[-1]}:`.",
            )
        return from_mapping(tp, value, source, lines, path)
    if origin in (list, tuple, collections.abc.Sequence) or tp in (list, tuple):
        if (
            isinstance(value, (str, bytes))
            or not isinstance(value, (list, tuple))
            or len(value) > MAX_ITEMS
        ):
            raise ConfigError(
                f"{where(source, lines, path)}: {key} must be a list of at most {MAX_ITEMS:,} items, not "
                f"{shown(value)}.",
                f"write {key}: [a, b].",
            )
        args = typing.get_args(tp)
        items = (
            [_convert(v, args[0], source, lines, path) for v in value]
            if args and args[0] is not Ellipsis
            else list(value)
        )
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin in (dict, collections.abc.Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{where(source, lines, path)}: {key} must be a mapping, not {shown(value)}.",
                f"write {key}: {{a: 1}}.",
            )
        # entries as given: their owner checks them (a runs file's env: YAML's true stays "True")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(
            f"{where(source, lines, path)}: {key} must be true or false, not {shown(value)}.",
            "write true or false.",
        )
    if tp is float:
        number: Optional[float] = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer of hundreds of digits
                number = math.inf
        elif isinstance(value, str) and len(value) <= 100:
            try:
                number = float(value)  # YAML 1.1 reads 1e-3 as a string
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
        if number is not None:
            raise ConfigError(
                f"{where(source, lines, path)}: {key} must be a finite number, not {shown(value)}.",
                f"give {key} a number (not nan or inf).",
            )
        if isinstance(value, str) and "," in value:  # Hydra's sweep of values (lr=1e-3,3e-3)
            raise ConfigError(
                f"{where(source, lines, path)}: {key} must be a number, not {shown(value)}.",
                f"give one value; several to sweep are `multigpu queue runs.yaml --sweep "
                f"'{key}={value[:40]}'`.",
            )
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            text = str(value)
            if len(text) > MAX_TEXT or not _encodable(text):
                raise ConfigError(
                    f"{where(source, lines, path)}: {key} must be UTF-8 text of at most {MAX_TEXT:,} "
                    f"characters, not {shown(value)}.",
                    f"give {key} a shorter, plain value.",
                )
            return text
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(
        f"{where(source, lines, path)}: {key} must be {_type_name(tp)}, not {shown(value)}.",
        f"give {key} a value of type {_type_name(tp)}.",
    )


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_keys(known: Any, given: Mapping[str, Any], owner: str, noun: str = "setting") -> None:
    """Refuse keys that ``known`` (a dataclass or a list of names) does not have, naming the nearest one."""
    names = (
        [f.name for f in dataclasses.fields(known) if f.init]
        if dataclasses.is_dataclass(known)
        else list(known)
    )
    for key in given:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = (
                f"did you mean {close[0]!r}?"
                if close
                else f"its {noun}s are: {', '.join(names) or 'none'}."
            )
            raise ConfigError(f"{owner} has no {noun} {str(key)[:80]!r}.", hint)


def bounds(
    low: Optional[float] = None, high: Optional[float] = None, items: Optional[int] = None
) -> dict[str, Any]:
    """A field's bounds, declared with it: ``field(default=None, metadata=bounds(1, 4096))``. A number is
    checked against ``low``..``high``, a list or mapping against ``items`` (entries); :func:`from_mapping`
    checks them with the types, so a value passed to a library is typed and bounded at one door."""
    return {"bounds": (low, high, items)}


def _in_bounds(
    value: Any, field: dataclasses.Field[Any], source: str, lines: Lines, path: tuple[str, ...]
) -> None:
    low, high, items = field.metadata.get("bounds", (None, None, None))
    key = ".".join(path)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if (low is not None and value < low) or (high is not None and value > high):
            raise ConfigError(
                f"{where(source, lines, path)}: {key} {shown(value)} is outside {low:g}..{high:g}.",
                f"give {key} a value from {low:g} to {high:g}.",
            )
    elif items is not None and isinstance(value, (list, tuple, dict)) and len(value) > items:
        raise ConfigError(
            f"{where(source, lines, path)}: {key} has {len(value):,} entries, more than {items:,}.",
            f"give {key} at most {items:,}.",
        )


def from_mapping(
    cls: type[T],
    data: Mapping[str, Any],
    source: str = "<config>",
    lines: Optional[Lines] = None,
    path: tuple[str, ...] = (),
) -> T:
    """Build dataclass ``cls`` from ``data``: unknown keys, wrong types and values outside a field's
    :func:`bounds` are errors with file:line."""
    lines = lines or {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = (
                f"did you mean {'.'.join((*path, close[0]))!r}?"
                if close
                else f"known keys: {', '.join(fields)}."
            )
            raise ConfigError(
                f"{where(source, lines, (*path, str(key)))}: unknown key {'.'.join((*path, str(key)))!r}.",
                hint,
            )
    values = {
        name: _convert(value, hints[name], source, lines, (*path, name))
        for name, value in data.items()
    }
    for name, value in values.items():
        _in_bounds(value, fields[name], source, lines, (*path, name))
    try:
        return cls(**values)
    # the class's own check: placed at the key it names, where it can be found
    except ConfigError as exc:
        named = [
            where(source, lines, (*path, name)) for name in values if f" {name}=" in exc.message
        ]
        raise ConfigError(f"{(named or [source])[0]}: {exc.message}", exc.hint) from None
    except TypeError as exc:
        missing = str(exc).split(":")[-1].strip()
        raise ConfigError(
            f"{source}: missing required setting(s) {missing} in {'.'.join(path) or 'the top level'}.",
            "add them to the file or pass KEY=VALUE.",
        ) from None


def load(cls: type[T], path: Optional[Union[str, Path]] = None, overrides: Sequence[str] = ()) -> T:
    """``cls`` from a YAML file (optional) plus ``key=value`` overrides, validated."""
    return from_mapping(cls, *gather(path, overrides))


def gather(
    path: Optional[Union[str, Path]] = None, overrides: Sequence[str] = ()
) -> tuple[dict[str, Any], str, Lines]:
    """A YAML file (optional) with ``key=value`` overrides set in it: (data, source, where each key came
    from) - what :func:`load` checks against its class, and what the launcher checks a part of early."""
    data, lines = load_yaml(path) if path else ({}, {})
    source = str(path) if path else "the defaults"
    given = {item.partition("=")[0].strip().lstrip("-"): item for item in overrides}
    for key, value in parse_overrides(overrides).items():
        set_dotted(data, key, value)
        parts = tuple(key.split("."))
        # the override is where this key (and its new groups) came from
        for depth in range(1, len(parts) + 1):
            if parts[:depth] not in lines or depth == len(parts):
                lines[parts[:depth]] = f"the command-line override {given.get(key, key)!r}"
    return data, source, lines


def to_dict(obj: Any) -> Any:
    """A dataclass as plain data (for writing the resolved config next to a run's outputs)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_yaml(obj: Any) -> str:
    text: str = yaml.safe_dump(to_dict(obj), sort_keys=False)
    return text
