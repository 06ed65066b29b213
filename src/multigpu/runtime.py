"""``mg.init()``: the one call at the top of a training script, and the :class:`Run` it returns.

Why: the script should not care whether torchrun, Slurm, ``multigpu run`` or nobody started it.
``init`` reads the world once, picks this process's device(s) and backend, starts the process group
with a finite timeout, and owns teardown (registered at exit, so a script that forgets still exits
cleanly). The ``Run`` composes the pieces a script needs; it holds no global state, so two runs in one
process (sequentially, or in tests) do not interfere.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, TypeVar

import torch

from multigpu import helpers
from multigpu.distributed import GroupSettings, ProcessGroup, choose_devices
from multigpu.world import World, detect_world

T = TypeVar("T")


@dataclass
class Run:
    """One training job as seen from this process."""

    world: World
    devices: list[torch.device]
    group: ProcessGroup
    _closed: bool = field(default=False, repr=False)

    # ------------------------------------------------------------------ where am I
    @property
    def device(self) -> torch.device:
        """The first (usually only) device of this process: put your batches here."""
        return self.devices[0]

    @property
    def backend(self) -> str:
        return self.group.backend

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def is_main(self) -> bool:
        return self.world.is_main

    # ------------------------------------------------------------------ helpers
    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print on global rank 0 only."""
        if self.world.is_main:
            kwargs.setdefault("flush", True)
            print(*args, **kwargs)

    def run_on_main(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return helpers.run_on_main(fn, *args, **kwargs)

    def barrier(self) -> None:
        if self.group.active:
            import torch.distributed as dist

            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Barrier, destroy the process group, flush. Safe to call twice; also runs at exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.group.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def init(
    *,
    backend: Optional[str] = None,
    timeout_s: float = 1800.0,
    accelerator: str = "auto",
    env: Optional[Mapping[str, str]] = None,
) -> Run:
    """Find where this process stands and join the others.

    ``backend``: nccl for GPUs and gloo for CPUs unless given. ``timeout_s``: how long a collective may
    wait for a missing rank before it fails (instead of hanging). ``accelerator``: 'auto', 'cuda' or
    'cpu'. ``env``: read this mapping instead of the process environment (tests).
    """
    world = detect_world(env)
    cuda_count = torch.cuda.device_count() if accelerator != "cpu" else 0
    devices = choose_devices(world, cuda_count, accelerator)
    settings = GroupSettings(backend=backend, timeout=timedelta(seconds=timeout_s))
    group = ProcessGroup(world, devices[0], settings).start()
    run = Run(world=world, devices=devices, group=group)
    atexit.register(run.close)
    return run
