"""The values a sweep may hold, as written in a runs file or on the command line: each one checked.

Why a module of its own: a swept value becomes a command-line override, a trial's name and its folder,
so it must be a finite number, true/false, null or short plain text - never a structure, a control
character or a number only Python reads (``1_000``). ``--sweep`` writes them as ``1e-3,3e-3`` or
``loguniform(1e-4,1e-1)``; a runs file as a list or a one-key mapping. Both end here.
"""

from __future__ import annotations

import math
import re
from typing import Any

from multigpu import validate
from multigpu.errors import ConfigError, shown

MAX_VALUES = 1_000


MAX_VALUE_TEXT = 200


_NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")  # ASCII digits only


_CALL = re.compile(r"\s*([A-Za-z_]\w*)\s*\((.*)\)\s*", re.S)


def written_values(text: str, at: str) -> Any:
    """``loguniform(1e-4, 1e-1)`` -> {"loguniform": [1e-4, 1e-1]}; ``1e-3,3e-3`` -> ['1e-3', '3e-3']."""
    if len(text) > 100 * MAX_VALUE_TEXT:
        raise ConfigError(f"{at}: {shown(text)} is too long.", "sweep fewer values.")
    match = _CALL.fullmatch(text)
    if match:
        arguments = (
            [part.strip() for part in match.group(2).split(",")] if match.group(2).strip() else []
        )
        return {match.group(1): [cli_scalar(part) for part in arguments]}
    if "(" in text or ")" in text:
        raise ConfigError(
            f"{at}: cannot read {shown(text)}.", "write e.g. loguniform(1e-4,1e-1) or 0.001,0.003."
        )
    return [cli_scalar(part.strip()) for part in text.split(",")] if text.strip() else []


def cli_scalar(text: str) -> Any:
    """A value written on the command line: a number, true/false/null, or text."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none", "~"):
        return None
    return text


def checked_values(values: Any, at: str) -> tuple[Any, ...]:
    if not isinstance(values, (list, tuple)):
        raise ConfigError(
            f"{at}: {shown(values)} is not a list of values.", "write e.g. [32, 64, 128]."
        )
    if not values:
        raise ConfigError(f"{at}: the list of values is empty.", "give at least one value.")
    if len(values) > MAX_VALUES:
        raise ConfigError(
            f"{at}: {len(values):,} values; at most {MAX_VALUES:,} per override.",
            "draw from a range instead: {uniform: [lo, hi]} or {int: [lo, hi]}, with samples: N.",
        )
    out = tuple(checked_value(v, at) for v in values)
    seen: dict[Any, Any] = {}
    for original, value in zip(values, out):
        marker = (
            type(value)
            if not isinstance(value, (int, float)) or isinstance(value, bool)
            else float,
            value,
        )
        if marker in seen:
            raise ConfigError(
                f"{at}: the value {shown(original)} is given twice (also as {shown(seen[marker])}).",
                "give each value once: the two trials would train the same thing.",
            )
        seen[marker] = original
    return out


def checked_value(value: Any, at: str) -> Any:
    """A swept value: a finite number, true/false, null, or short plain text (numbers written as text,
    like YAML's ``1e-3``, become numbers)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > 2**63:
            raise ConfigError(f"{at}: {shown(value)} is too large.", "give a number below 2**63.")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(
                f"{at}: {shown(value)} is not a finite number.",
                "give finite numbers (no nan or inf).",
            )
        return value
    if isinstance(value, str):
        if len(value) > MAX_VALUE_TEXT:
            raise ConfigError(
                f"{at}: a value of {len(value):,} characters; at most {MAX_VALUE_TEXT}.",
                "give short values (a name, a number).",
            )
        validate.plain_text(value, f"{at}: value", ConfigError)
        if _NUMBER.fullmatch(value.strip()):
            number = float(value)
            if not math.isfinite(number):
                raise ConfigError(
                    f"{at}: {shown(value)} is not a finite number.", "give a smaller number."
                )
            return int(value) if re.fullmatch(r"[-+]?[0-9]+", value.strip()) else number
        if value.strip().lower() in (
            "nan",
            "inf",
            "+inf",
            "-inf",
            "infinity",
            ".nan",
            ".inf",
            "-.inf",
        ):
            raise ConfigError(
                f"{at}: {shown(value)} is not a finite number.",
                "give finite numbers (no nan or inf).",
            )
        return value
    raise ConfigError(
        f"{at}: {shown(value)} is not a number, true/false, null or text.",
        "sweep single values; put structured settings in separate runs.",
    )
