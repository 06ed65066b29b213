"""Reconciling a checkpoint with the run that resumes it: pure functions, tested without processes.

Why apart from the loop: a resumed run is rarely the same run. The learning rate was changed, the
world size or the batch size differ, a setting was added - and a checkpoint is data from disk that
may be damaged. Each question here takes the saved values and the current ones and returns the
answer (new counters, the changes made, the differences to print); none reads a file, starts a
collective or keeps state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

from multigpu.errors import CheckpointError
from multigpu.trainer.settings import TrainState

#: Settings that say where a run starts, not how it trains: never listed as changed on a resume.
WHERE_TO_START = ("resume", "fresh", "resume_from")
#: Optimizer settings that a resumed run takes from the code, not from the checkpoint.
HYPERPARAMETERS = (
    "lr",
    "weight_decay",
    "momentum",
    "betas",
    "eps",
    "dampening",
    "nesterov",
    "alpha",
    "lr_decay",
)


def wanted_hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hyperparameters given now, per group: taken before the checkpoint overwrites them."""
    return [{k: g[k] for k in (*HYPERPARAMETERS, "initial_lr") if k in g} for g in param_groups]


def apply_hyperparameters(
    param_groups: list[dict[str, Any]],
    wanted: list[dict[str, Any]],
    base_lrs: Optional[list[Any]] = None,
) -> list[str]:
    """Put the hyperparameters given now back into groups the checkpoint restored; return what changed.

    A changed initial learning rate scales the scheduled one, so the schedule's position is kept;
    ``base_lrs``: the scheduler's list of initial rates, updated to match.
    """
    if len(param_groups) != len(wanted):
        return [
            f"optimizer param groups {len(wanted)} -> {len(param_groups)} (kept the checkpoint's)"
        ]
    changes = []
    for index, (group, new) in enumerate(zip(param_groups, wanted)):
        name = f"optimizer{'' if len(param_groups) == 1 else f' group {index}'}"
        for key, value in new.items():
            if key in ("lr", "initial_lr") or group.get(key) == value:
                continue
            changes.append(f"{name} {key} {group.get(key)!r} -> {value!r}")
            group[key] = value
        new_base, old_base = (
            new.get("initial_lr", new.get("lr")),
            group.get("initial_lr", group.get("lr")),
        )
        if new_base is None or old_base is None or new_base == old_base:
            continue
        changes.append(f"{name} lr {old_base!r} -> {new_base!r}")
        if "initial_lr" in group and old_base:
            group["lr"] = group["lr"] * new_base / old_base
            group["initial_lr"] = new_base
            if base_lrs is not None:
                base_lrs[index] = new_base
        else:
            group["lr"] = new_base
    return changes


def changed_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``label.key old -> new`` for each setting that differs; ``saved``/``current``: label -> settings."""
    changes = []
    for label, new in current.items():
        old = saved.get(label)
        if not isinstance(old, Mapping) or not isinstance(new, Mapping):
            continue
        for key, (before, after) in diff(old, plain_data(new)).items():
            if key.rsplit(".", 1)[-1] in WHERE_TO_START:
                continue
            changes.append(f"{label}.{key} {before!r} -> {after!r}")
    return changes


def realigned_batches(
    batch_in_epoch: int,
    data: Mapping[str, Any],
    new_global: int,
    say: Callable[[str], None] = print,
) -> int:
    """Resuming mid-epoch with another world size or batch: the batch index after the same global sample
    (``say``: prints the samples seen twice, once - on rank 0)."""
    if not batch_in_epoch or not data:
        return batch_in_epoch
    old_global = data["batch_size"] * data.get("dp_size", data.get("world_size", 1))
    if old_global == new_global:
        return batch_in_epoch
    done = batch_in_epoch * old_global
    if done % new_global:
        say(
            f"multigpu: resuming mid-epoch with global batch {new_global} (was {old_global}); "
            f"{done % new_global} sample(s) of this epoch are seen twice."
        )
    batches: int = done // new_global
    return batches


def checked_counters(value: Any) -> TrainState:
    """The Trainer's counters from a checkpoint, or a CheckpointError: never a negative or absurd step."""
    names = [f.name for f in dataclasses.fields(TrainState)]
    if (
        not isinstance(value, Mapping)
        or sorted(value) != sorted(names)
        or not all(
            isinstance(value[k], int) and not isinstance(value[k], bool) and 0 <= value[k] < 2**53
            for k in names
        )
    ):
        raise CheckpointError(
            f"the checkpoint's trainer counters are malformed: {str(value)[:120]}",
            "it is corrupt or not from this Trainer; use an earlier one.",
        )
    return TrainState(**value)


def checked_data_layout(data: Any) -> Mapping[str, Any]:
    """The saved data layout (batch size, data-parallel size, world size), each a positive integer."""
    data = data or {}
    if not isinstance(data, Mapping) or not all(
        isinstance(data.get(k, 1), int) and data.get(k, 1) >= 1
        for k in ("batch_size", "dp_size", "world_size")
    ):
        raise CheckpointError(
            "the checkpoint's data layout is malformed.", "it is corrupt; use an earlier one."
        )
    return data


def plain_data(value: Any) -> Any:
    """Only what ``torch.load(weights_only=True)`` reads back: containers, numbers, text."""
    if isinstance(value, Mapping):
        return {str(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def diff(
    old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = ""
) -> dict[str, tuple[Any, Any]]:
    """Flattened ``key: (old, new)`` for every leaf that differs."""
    out = {}
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.update(diff(a, b, f"{prefix}{key}."))
        elif a != b:
            out[f"{prefix}{key}"] = (a, b)
    return out
