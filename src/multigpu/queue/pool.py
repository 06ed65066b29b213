"""The queue's pool: which GPUs (or, on a CPU machine, how many process slots) runs are placed on.

Why apart from the scheduler: the rules are the launcher's (``--gpus`` indexes the visible GPUs, with
the same errors as ``multigpu run``) plus a slot count on CPU machines; pure functions, unit-tested
without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from multigpu import validate
from multigpu.errors import ConfigError
from multigpu.launch.devices import plan_devices
from multigpu.launch.local import usable_cores


@dataclass(frozen=True)
class Pool:
    # GPU ids as CUDA_VISIBLE_DEVICES names them, or "0".."N-1" for CPU slots
    slots: tuple[str, ...]
    on_gpus: bool

    @property
    def unit(self) -> str:
        return "GPU(s)" if self.on_gpus else "slot(s)"


def plan_pool(
    visible_gpus: Sequence[str], gpus: Optional[str] = None, slots: Optional[int] = None
) -> Pool:
    """``--slots N``: N CPU process slots (also where GPUs exist); else the GPUs named by ``--gpus``
    (indexes into the visible ones), else every visible GPU, else one CPU slot per usable core."""
    if slots is not None and gpus is not None:
        raise ConfigError(
            "--slots and --gpus contradict each other.",
            "--gpus places runs on GPUs, --slots on CPU process slots: give one.",
        )
    if slots is None and (visible_gpus or gpus is not None):
        visible = plan_devices(visible_gpus, gpus=gpus).visible
        if visible is None:  # GPUs are visible or named here, so the plan names them
            raise ConfigError(
                "no GPU to place runs on.", "give --slots N to run on CPU process slots."
            )
        return Pool(tuple(visible.split(",")), True)
    count = validate.count(slots if slots is not None else usable_cores(), "--slots", ConfigError)
    return Pool(tuple(str(i) for i in range(count)), False)
