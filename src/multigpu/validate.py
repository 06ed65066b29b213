"""Checks for values that come from outside - flags, runs files, environment - before they are used.

Why one module: the same few rules (a count within sane bounds, a name that is safe as a folder, an
environment variable name that is an identifier, text without control characters) guard the launcher,
the queue and the Slurm scripts. Each check raises the caller's error type with a HINT, so a bad value
is one line at the door instead of a traceback - or a shell line, or a folder outside the output -
further in. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from multigpu.errors import MultiGPUError, shown

#: No machine has more cores or GPUs than this per node; a larger count is a typo (``--nproc 100000``).
MAX_PROCS_PER_NODE = 4096
#: Processes sharing one GPU (``--procs-per-gpu``) or runs packed onto one (``--runs-per-gpu``): each
#: holds a CUDA context, so more than this only fills the GPU with contexts.
MAX_SHARERS_PER_GPU = 16
#: Slurm's own limits are far below this; it only catches typos before a script is written.
MAX_NODES = 65536
MAX_SIMULATED_NODES = 64
#: Run names become folder names (and Slurm job names): a safe, portable subset.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
#: Control characters: a newline ends an #SBATCH block or a shell line.
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


#: A whole number as a person or a launcher writes one: ASCII digits and an optional sign. Python's
#: int() takes more - "١٢" (Arabic-Indic digits), "1_000", " 7 " - and none of that is a number here.
_WHOLE = re.compile(r"[-+]?[0-9]{1,100}")


def is_digits(text: object) -> bool:
    """``text`` is ASCII digits only (no sign): what str.isdigit() means to a reader, not "²" or "١".
    At most 100 of them, as in a whole number: callers convert with int(), which refuses more than 4300
    digits with a ValueError (a traceback where a Slurm job id or a log file name held them)."""
    return isinstance(text, str) and re.fullmatch(r"[0-9]{1,100}", text) is not None


def whole_number(
    text: object, what: str, error: type[MultiGPUError] = MultiGPUError, hint: str = ""
) -> int:
    """``text`` (a flag, a YAML value, an environment variable) as an int: ASCII digits and a sign only."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if not isinstance(text, str) or not _WHOLE.fullmatch(text):
        raise error(
            f"{what}={shown(text, 60)} is not an integer.",
            hint
            or f"write {what} with the digits 0-9 only (no underscores or other scripts' digits).",
        )
    return int(text)


def whole_flag(text: str) -> int:
    """argparse's ``type=`` for whole-number flags, in place of ``int`` (which takes "١٢" and "1_000")."""
    if not _WHOLE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{shown(text, 60)} is not a whole number (write it with the digits 0-9)"
        )
    return int(text)


def count(
    value: object,
    what: str,
    error: type[MultiGPUError] = MultiGPUError,
    low: int = 1,
    high: int = MAX_PROCS_PER_NODE,
    hint: Optional[str] = None,
) -> int:
    """``value`` as an int within ``low..high`` (booleans and non-integers are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(
            f"{what} {value!r} is not a whole number.",
            hint or f"use a number from {low} to {high}.",
        )
    if value < low:
        raise error(f"{what} {value} must be at least {low}.", hint or f"use {low} or more.")
    if value > high:
        raise error(
            f"{what} {value} is more than {high:,}.",
            hint
            or f"use at most {high:,}; no machine runs more per node (a typo?). "
            "If you really need more, please open an issue.",
        )
    return value


def positive_seconds(
    value: object,
    what: str,
    error: type[MultiGPUError] = MultiGPUError,
    high: float = 7 * 24 * 3600,
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
        raise error(
            f"{what} {value!r} must be a positive number of seconds (at most {high:g}).",
            f"e.g. {what} 120.",
        )
    return float(value)


def run_name(name: object, error: type[MultiGPUError] = MultiGPUError, where: str = "") -> str:
    """A run name that is safe as one folder name: letters, digits, ``._-``, no leading dot, <= 100."""
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
        raise error(
            f"{where}run name {shown} is not allowed: it becomes a folder name.",
            "use letters, digits and . _ - (not first: . or -), at most 100 characters.",
        )
    return name


def plain_text(
    value: object,
    what: str,
    error: type[MultiGPUError] = MultiGPUError,
    allow_space: bool = True,
    pattern: Optional[str] = None,
    example: str = "",
) -> str:
    """Text with no control characters (newlines end #SBATCH blocks and shell lines), optionally matched;
    always encodable as UTF-8 (a lone surrogate from a YAML escape cannot be written to a file)."""
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise error(
            f"{what} {text[:40]!r} is not valid Unicode text.", "remove the \\uD800-style escape."
        ) from None
    if CONTROL.search(text) or (not allow_space and re.search(r"\s", text)):
        raise error(
            f"{what} {text[:60]!r} contains {'whitespace or ' if not allow_space else ''}control characters.",
            f"give a single plain value{f', e.g. {example}' if example else ''}.",
        )
    if pattern is not None and not re.fullmatch(pattern, text):
        raise error(
            f"{what} {text[:60]!r} is not a valid value.",
            f"e.g. {example}." if example else "check it.",
        )
    return text


# ---------------------------------------------------------------------------- the settings door
#: Text settings longer than this are refused (a path, a name, a metric); lists longer than MAX_ITEMS too.
MAX_TEXT = 4096
MAX_ITEMS = 10_000


@dataclass(frozen=True)
class Rule:
    """What one setting may be: its type, bounds or choices, and whether None is allowed."""

    kind: type
    low: Optional[float] = None
    high: Optional[float] = None
    choices: Optional[tuple[Any, ...]] = None
    optional: bool = False
    #: The lowest value is excluded (a positive number of seconds).
    positive: bool = False
    #: Text may be empty or only spaces (False for a path: ``--resume ""`` must not silently not resume).
    blank: bool = True

    def describe(self) -> str:
        if self.choices is not None:
            wanted = " or ".join(repr(c) for c in self.choices)
        elif self.kind is bool:
            wanted = "true or false"
        elif self.kind in (int, float):
            noun = "a whole number" if self.kind is int else "a number"
            lo = (
                ""
                if self.low is None
                else f"{'above' if self.positive else 'from'} {_number(self.low)}"
            )
            hi = "" if self.high is None else f"{'up ' if not lo else ''}to {_number(self.high)}"
            wanted = f"{noun} {lo} {hi}".strip()
        elif self.kind is str:
            wanted = f"{'' if self.blank else 'non-blank '}text of at most {MAX_TEXT} characters"
        else:
            wanted = f"a {self.kind.__name__}"
        return f"{wanted}{', or null' if self.optional else ''}"


def setting(default: Any = dataclasses.MISSING, **rule: Any) -> Any:
    """A dataclass field with its bounds declared beside it, ``epochs: int = setting(1, low=0, high=10**9)``
    (``low``, ``high``, ``choices``, ``positive``, ``blank`` as :class:`Rule` has them); its type and whether
    None is allowed are the annotation's (:func:`rules_of`)."""
    return dataclasses.field(default=default, metadata={"rule": rule})


def rules_of(cls: type) -> dict[str, Rule]:
    """Each field's :class:`Rule`: the annotation's type (``Optional``: None allowed) and the bounds its
    :func:`setting` declares. Fields of other types (``Any``, mappings, functions) have no rule here: their
    own checks read them."""
    hints = typing.get_type_hints(cls)
    rules = {}
    for item in dataclasses.fields(cls):
        kind, optional = _kind(hints[item.name])
        if kind is not None:
            rules[item.name] = Rule(kind, optional=optional, **item.metadata.get("rule", {}))
        elif "rule" in item.metadata:
            raise TypeError(
                f"{cls.__name__}.{item.name}: bounds on a field of type {hints[item.name]}"
            )
    return rules


def _kind(annotation: Any) -> tuple[Optional[type], bool]:
    """``Optional[int]`` -> (int, True); ``list[Any]`` -> (list, False); anything else -> (None, False)."""
    optional = False
    if typing.get_origin(annotation) is typing.Union:
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        optional = len(rest) < len(typing.get_args(annotation))
        if len(rest) != 1:
            return None, False
        annotation = rest[0]
    origin = typing.get_origin(annotation) or annotation
    return (origin, optional) if origin in (bool, int, float, str, list) else (None, False)


def checked(
    owner: str, name: str, value: Any, rule: Rule, error: type[MultiGPUError] = MultiGPUError
) -> Any:
    """``value`` if it follows ``rule``; otherwise one line naming the setting and what it may be."""
    if value is None and rule.optional:
        return value
    ok = True
    if rule.kind is bool or isinstance(value, bool):
        ok = isinstance(value, bool) and rule.kind is bool
    elif rule.kind is float:
        ok = isinstance(value, (int, float)) and math.isfinite(value)
    elif rule.kind is str:
        ok = (
            isinstance(value, str)
            and len(value) <= MAX_TEXT
            and not CONTROL.search(value)
            and _utf8(value)
        )
        ok = ok and (rule.blank or bool(value.strip()))
    elif rule.kind is list:
        ok = isinstance(value, (list, tuple)) and len(value) <= MAX_ITEMS
    else:
        ok = isinstance(value, rule.kind)
    if ok and rule.choices is not None:
        ok = value in rule.choices
    if ok and rule.kind in (int, float):
        ok = (rule.low is None or (value > rule.low if rule.positive else value >= rule.low)) and (
            rule.high is None or value <= rule.high
        )
    if not ok:
        raise error(f"{owner} setting {name}={shown(value)} is invalid.", f"use {rule.describe()}.")
    return value


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


#: ``activation_checkpointing`` as a mapping: which blocks (class names) and how often.
CHECKPOINTING_KEYS = {"blocks": Rule(list, optional=True), "every": Rule(int, 1, 10**6)}


def activation_checkpointing_settings(
    value: Any, error: type[MultiGPUError] = MultiGPUError
) -> Any:
    """``activation_checkpointing``: false, true (every repeated block), or ``{every: N, blocks: [Name]}``.

    Returned as false or ``{"blocks": [names] or None, "every": N}``: the one form the strategies read."""
    if isinstance(value, bool):
        return {"blocks": None, "every": 1} if value else False
    if not isinstance(value, Mapping) or not value:
        raise error(
            f"trainer setting activation_checkpointing={shown(value)} is invalid.",
            "use true, false, {every: 2} (every 2nd block) or {blocks: [Block]} (class names).",
        )
    for key, item in value.items():
        if key not in CHECKPOINTING_KEYS:
            raise error(
                f"activation_checkpointing has no key {shown(key)}.", "use every and/or blocks."
            )
        checked("activation_checkpointing", str(key), item, CHECKPOINTING_KEYS[key], error)
    blocks = value.get("blocks")
    if blocks is not None:
        if not blocks:
            raise error(
                "activation_checkpointing.blocks=[] names no block.",
                "name a class, e.g. {blocks: [Block]}.",
            )
        for name in blocks:
            plain_text(
                name,
                "activation_checkpointing block name",
                error,
                allow_space=False,
                pattern=r"[A-Za-z_][A-Za-z0-9_]{0,199}",
                example="Block",
            )
    return {"blocks": list(blocks) if blocks is not None else None, "every": value.get("every", 1)}
