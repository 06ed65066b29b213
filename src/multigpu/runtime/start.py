"""``mg.init()``: find where this process stands, pick its device(s), join the others, return the Run."""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Mapping, Optional

import torch

from multigpu.checkpoint.rng import seed_everything
from multigpu.distributed.parallel import Parallelism
from multigpu.distributed.session import DistSession, GroupSettings, choose_devices
from multigpu.distributed.world import detect_world, read_job
from multigpu.guards import interrupt, probe as check_probe
from multigpu.runtime.run import Run

#: What each process on a GPU holds outside PyTorch's allocator (its CUDA context, cuBLAS workspaces):
#: kept out of a packed run's allocator cap, so K runs at 1/K each never overfill the GPU together.
CONTEXT_RESERVE_BYTES = 1 << 30


def allocator_fraction(share: float, device: torch.device) -> float:
    """The cap for PyTorch's allocator that keeps a process within ``share`` of the GPU: the share less
    the memory its CUDA context takes outside the allocator (1 GiB, at most a quarter of the share)."""
    total = torch.cuda.get_device_properties(device).total_memory
    mine = share * total
    return (mine - min(CONTEXT_RESERVE_BYTES, mine / 4)) / total


def init(
    *,
    backend: Optional[str] = None,
    timeout_s: float = 1800.0,
    accelerator: str = "auto",
    strategy: str = "auto",
    seed: Optional[int] = None,
    same_random_streams: bool = False,
    tp: int = 1,
    dp_replicate: int = 1,
    pp: int = 1,
    env: Optional[Mapping[str, str]] = None,
) -> Run:
    """Find where this process stands and join the others.

    ``backend``: nccl for GPUs and gloo for CPUs unless given. ``timeout_s``: how long a collective may wait for a
    missing rank before it fails (instead of hanging; joining waits 600 s at least:
    ``GroupSettings.join_timeout``). ``accelerator``: 'auto', 'cuda' or 'cpu'. ``strategy``: what ``run.setup``
    wraps models with (see ``multigpu.strategies``; auto: ddp with several processes, single otherwise). ``seed``:
    seed python, numpy and torch the same on every rank now - models built before ``run.setup`` are identical -
    and per rank after it, so dropout and augmentation differ between ranks as they differ between samples of one
    process (``same_random_streams=True`` keeps them equal). ``tp``, ``dp_replicate``, ``pp``: parallelism degrees
    (the rest shards data; ``pp``: stages on consecutive groups of ranks). ``env``: instead of os.environ.
    """
    world, job = detect_world(env), read_job(env)
    cuda_count = torch.cuda.device_count() if accelerator != "cpu" else 0
    devices = choose_devices(world, cuda_count, accelerator)
    if job.memory_fraction is not None and devices[0].type == "cuda":
        for device in (
            devices
        ):  # a packed queue run: an allocation beyond its share fails here, not in a neighbour
            torch.cuda.set_per_process_memory_fraction(
                allocator_fraction(job.memory_fraction, device), device
            )
    parallelism = Parallelism.from_degrees(
        world.world_size, world.local_world_size, dp_replicate=dp_replicate, tp=tp, pp=pp
    )
    settings = GroupSettings(backend=backend, timeout=timedelta(seconds=timeout_s))
    session = DistSession(world, devices[0], settings).start()
    run = Run(
        world=world,
        job=job,
        devices=devices,
        session=session,
        strategy_name=strategy,
        parallelism=parallelism,
        seed=seed,
        same_random_streams=same_random_streams,
        probe=check_probe.from_job(job, world.rank),
    )
    atexit.register(run.close)
    interrupt.install(run.guards, world.is_distributed)
    if seed is not None:
        seed_everything(seed)
    return run
