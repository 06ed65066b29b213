"""Desync guard: ranks compare a fingerprint before training and fail together, with a readable diff.

Why: ranks that disagree (a different config file on one node, another dataset version, another
torch) do not fail - they hang in the first collective whose shapes or counts differ, or silently
train different things. One all-gather of a small dictionary at start turns that into an error on
every rank within seconds, naming each key that differs and the values on each rank.
"""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from multigpu.distributed.session import group_active
from multigpu.errors import DesyncError


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Parameter names, shapes and dtypes (hashed, with counts kept readable)."""
    entries = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    digest = hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]
    return {
        "parameters": len(entries),
        "parameter_elements": sum(p.numel() for p in model.parameters()),
        "parameter_layout": digest,
    }


def config_hash(config: Any) -> str:
    """A hash of plain data. Values JSON cannot hold are hashed by their repr (a Path, an Enum, a numpy
    scalar, a dtype differ by value), sets in sorted order, and by type name only where the repr carries
    a memory address (a function, an object without a repr), which differs per process."""

    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(repr(v) for v in value)
        text = repr(value)
        return (
            f"<{type(value).__qualname__}>"
            if " at 0x" in text
            else f"<{type(value).__qualname__} {text[:500]}>"
        )

    text = json.dumps(config, sort_keys=True, default=plain)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: Keys of a config compared one by one (beyond it, the whole config is one hash): the all-gather stays small.
MAX_ITEMS = 256


def config_items(name: str, config: Any) -> dict[str, str]:
    """A config as ``{"name.key.sub": value}``, so a difference is named down to the setting: short
    scalars are shown as they are (``out_dir: rank 0 = '/tmp/a', rank 1 = '/tmp/b'``), anything else
    by hash. A config that is not a mapping, or too large, is one entry."""
    items: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if len(items) > MAX_ITEMS:
            return
        value = plain(value)
        if isinstance(value, Mapping) and value:
            for key in sorted(value, key=str):
                walk(f"{prefix}.{key}", value[key])
        elif isinstance(value, (str, int, float, bool, type(None))) and len(repr(value)) <= 80:
            items[prefix] = repr(value)
        else:
            items[prefix] = config_hash(value)

    walk(name, config)
    return items if len(items) <= MAX_ITEMS else {name: config_hash(plain(config))}


def plain(config: Any) -> Any:
    """A recipe config as plain data: dataclasses become dicts (anything else is hashed as it is)."""
    import dataclasses

    return (
        dataclasses.asdict(config)
        if dataclasses.is_dataclass(config) and not isinstance(config, type)
        else config
    )


def environment_fingerprint() -> dict[str, str]:
    from multigpu import __version__

    return {
        "torch": torch.__version__,
        "multigpu": __version__,
        "python": platform.python_version(),
    }


def compare(fingerprints: list[Mapping[str, Any]]) -> list[str]:
    """Differences from rank 0, one line per key: ``batch_size: rank 0 = 32, rank 1 = 16``."""
    reference = fingerprints[0]
    keys = sorted(set().union(*fingerprints), key=str)
    lines = []
    for key in keys:
        values = [fp.get(key, "<missing>") for fp in fingerprints]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(
                f"rank {r} = {v}"
                for r, v in enumerate(values)
                if r == 0 or v != reference.get(key, "<missing>")
            )
            lines.append(f"{key}: {shown}")
    return lines


def check_same_on_all_ranks(fingerprint: Mapping[str, Any], group: Optional[Any] = None) -> None:
    """All-gather ``fingerprint``; raise :class:`DesyncError` on every rank if any rank differs."""
    if not group_active():
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(fingerprint), group=group)
    differences = compare(gathered)
    if differences:
        raise DesyncError(
            f"ranks disagree before training ({len(differences)} difference(s)): "
            + "; ".join(differences),
            "start every rank with the same config, code, data and package versions (a shared "
            "filesystem or the same container image on every node).",
        )
