"""A runs file's ``child < parent`` entries resolved into whole runs (the queue's and ``multigpu slurm``'s).

Why a module of its own: inheritance is how a runs file reads, not how a YAML file becomes settings
(``config``), and it has its own bounds: a cycle, an unknown parent, a chain longer than 100 runs, or
a file whose runs would expand past a million values is one line naming the entry.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping, Optional

from multigpu.config import merge, where
from multigpu.config.yaml_file import Lines
from multigpu.errors import ConfigError

MAX_INHERITANCE = 100


def split_run_key(key: str) -> tuple[str, Optional[str]]:
    name, sep, parent = str(key).partition("<")
    return name.strip(), (parent.strip() or None) if sep else None


#: Settings all runs of a runs file may hold once inheritance is resolved: 3,000 children of a parent
#: with 20,000 keys would copy 60 million values (minutes of CPU) before the first error could show.
MAX_RESOLVED_VALUES = 1_000_000


def _values(value: Any) -> int:
    if isinstance(value, Mapping):
        return 1 + sum(_values(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return 1 + sum(_values(v) for v in value)
    return 1


def _bound_expansion(
    own: Mapping[str, dict[str, Any]], parents: Mapping[str, Optional[str]], source: str
) -> None:
    """Refuse, before merging anything, a file whose runs would expand past MAX_RESOLVED_VALUES."""
    sizes = {name: _values(settings) for name, settings in own.items()}
    total = 0
    for name in own:
        seen: set[str] = set()
        current: Optional[str] = name
        while (
            current is not None
            and current not in seen
            and current in own
            and len(seen) <= MAX_INHERITANCE
        ):
            seen.add(current)
            total += sizes[current]
            current = parents.get(current)
        if total > MAX_RESOLVED_VALUES:
            raise ConfigError(
                f"{source}: its runs hold more than {MAX_RESOLVED_VALUES:,} settings once inheritance "
                "is resolved.",
                "split the runs file, or give large parents fewer settings.",
            )


def resolve_inheritance(
    data: Mapping[str, Any], source: str = "<runs>", lines: Optional[Lines] = None
) -> dict[str, dict[str, Any]]:
    """``{"net": {...}, "larger_net < net": {...}}`` -> every entry with its ancestors' settings merged in.

    ``child < parent`` takes every setting of ``parent`` (deeply: nested groups merge key by key) and
    overrides some. Chains are allowed; a cycle, an unknown parent or a name defined twice is an error
    naming the line.
    """
    lines = lines or {}
    own: dict[str, dict[str, Any]] = {}
    parents: dict[str, Optional[str]] = {}
    defined_at: dict[str, str] = {}
    for key, value in data.items():
        name, parent = split_run_key(key)
        at = where(source, lines, (str(key),))
        if not name:
            raise ConfigError(
                f"{at}: {key!r} has no run name before '<'.", "write `child < parent:`."
            )
        if name in own:
            raise ConfigError(
                f"{at}: run {name!r} is defined twice (also at {defined_at[name]}).",
                "give each run one entry.",
            )
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(
                f"{at}: run {name!r} must be a group of settings, not {value!r}.",
                f"indent its settings under `{key}:`.",
            )
        own[name], parents[name], defined_at[name] = dict(value or {}), parent, at
    for name, parent in parents.items():
        if parent is not None and parent not in own:
            close = difflib.get_close_matches(parent, list(own), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"defined runs: {', '.join(own)}."
            raise ConfigError(
                f"{defined_at[name]}: {name!r} inherits from {parent!r}, which is not defined.",
                hint,
            )
    _bound_expansion(own, parents, source)
    resolved: dict[str, dict[str, Any]] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> dict[str, Any]:
        if len(chain) > MAX_INHERITANCE:
            raise ConfigError(
                f"{defined_at[name]}: inheritance chain longer than {MAX_INHERITANCE} runs.",
                "shorten the chain of `child < parent` entries.",
            )
        if name in chain:
            cycle = " < ".join((*chain[chain.index(name) :], name))
            raise ConfigError(
                f"{defined_at[name]}: inheritance cycle {cycle}.",
                "break the cycle: a run cannot inherit from itself.",
            )
        if name not in resolved:
            parent = parents[name]
            base = resolve(parent, (*chain, name)) if parent is not None else {}
            resolved[name] = merge(base, own[name])
        return resolved[name]

    for name in own:
        resolve(name, ())
    return {name: resolved[name] for name in own}
