"""A trial's name from its values: ``net-lr0.001-hidden64``, stable, distinct, and safe as a folder name.

Why a module of its own: a sweep, a random search and a resumed queue must all give a point the same
name (its folder is how a restarted queue finds what is done), and no two trials one folder - also on
file systems that ignore case.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Mapping, Optional, Sequence

from multigpu import validate
from multigpu.errors import ConfigError


def trial_name(
    family: str,
    values: Mapping[str, Any],
    labels: Optional[Mapping[str, str]] = None,
    prefix: str = "",
    short: bool = False,
) -> str:
    """``net-lr0.001-hidden64`` (``prefix``: ``s3`` for a random sample, ``t7`` for a search trial). Too
    long for a folder name: cut, with a hash of every value so that it stays distinct and stable."""
    labels = labels or labels_of(list(values))
    parts = [prefix] if prefix else []
    parts += [
        f"{labels[key]}{safe_part(value_text(value, short))}" for key, value in values.items()
    ]
    name = "-".join([family, *parts])
    if len(name) > 100:
        digest = hashlib.sha256(stable_text(values).encode()).hexdigest()[:8]
        name = f"{name[:90]}-{digest}"
    return name


def value_text(value: Any, short: bool = False) -> str:
    """A value as a name shows it: exact for listed values, 3 significant digits for drawn ones."""
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.3g}" if short else repr(value)
    return str(value)


def labels_of(keys: Sequence[str]) -> dict[str, str]:
    """The last part of each dotted key (``optim.lr`` -> ``lr``), the whole key where two would clash."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {
        key: safe_part(key if last.count(short) > 1 else short) for key, short in zip(keys, last)
    }


def safe_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text).replace("+", "")[:40]


def stable_text(values: Mapping[str, Any]) -> str:
    return ";".join(f"{key}={value!r}" for key, value in values.items())


def check_names(names: Sequence[tuple[str, str]], taken: Mapping[str, str]) -> None:
    """Refuse two trials (or a trial and a run) with one name (or names differing only in case:
    one folder on some file systems). ``names``: (name, what it is); ``taken``: lowercased -> run."""
    seen = dict(taken)
    for name, what in names:
        validate.run_name(name, ConfigError, f"{what}: ")
        folded = name.lower()
        if folded in seen:
            raise ConfigError(
                f"{what} would be named {name!r}, like {seen[folded]}.",
                "make the values differ in their first 3 significant digits, rename the family, or "
                "rename the other run: each trial needs its own folder.",
            )
        seen[folded] = what
