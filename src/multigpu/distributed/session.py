"""Start and stop ``torch.distributed`` for a :class:`~multigpu.distributed.world.World`: device, backend, timeouts.

Why a module of its own: the device a process owns, the backend that fits it and a clean exit are the
same for every strategy and every launcher. Getting them wrong produces the classic failures: two
processes on ``cuda:0``, NCCL on a CPU tensor, a 30-minute hang when one rank is gone, or a worker that
aborts at interpreter shutdown after a successful run.
"""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from multigpu.distributed.world import World
from multigpu.errors import LaunchError, WorldError

BACKENDS = ("nccl", "gloo", "mpi", "xccl")


def choose_devices(world: World, cuda_count: int, accelerator: str = "auto") -> list[torch.device]:
    """The devices this process owns: ``devices_per_process`` GPUs starting at ``local_rank * K``, or,
    with ``processes_per_device`` P > 1, the one GPU ``local_rank // P`` that P processes share.

    ``cuda_count`` is what this process can see (after the launcher set CUDA_VISIBLE_DEVICES).
    """
    if accelerator not in ("auto", "cpu", "cuda"):
        raise LaunchError(f"unknown accelerator {accelerator!r}.", "use 'auto', 'cuda' or 'cpu'.")
    if accelerator == "cpu" or (accelerator == "auto" and cuda_count == 0):
        return [torch.device("cpu")]
    if cuda_count == 0:
        raise LaunchError(
            "accelerator='cuda' was asked for but no GPU is visible.",
            "use accelerator='auto' or 'cpu'.",
        )
    per_proc, sharing = world.devices_per_process, world.processes_per_device
    first = world.local_rank // sharing if sharing > 1 else world.local_rank * per_proc
    last = first + per_proc - 1
    if last >= cuda_count:
        visible = (
            f" (CUDA_VISIBLE_DEVICES={world.visible_devices})"
            if world.visible_devices is not None
            else ""
        )
        if sharing > 1:
            needed = (
                f"{world.local_world_size} process(es) per node at {sharing} per GPU = "
                f"{-(-world.local_world_size // sharing)}"
            )
        else:
            needed = (
                f"{world.local_world_size} process(es) per node x {per_proc} GPU(s) each = "
                f"{world.local_world_size * per_proc}"
            )
        raise WorldError(
            f"local rank {world.local_rank} needs GPU {first}"
            + (f"-{last}" if per_proc > 1 else "")
            + f" but only {cuda_count} GPU(s) are visible{visible}; {needed}.",
            "start one process per GPU on each node: --ntasks-per-node (Slurm) or --nproc equal to the "
            "GPUs per node, divided by --gpus-per-proc (or times --procs-per-gpu).",
        )
    return [torch.device("cuda", first + i) for i in range(per_proc)]


def choose_backend(
    device: torch.device, requested: Optional[str] = None, shared: bool = False
) -> str:
    """nccl for GPUs, gloo for CPUs - and gloo for GPUs that several processes share (``shared``):
    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), gloo moves CUDA tensors through the host."""
    if requested is not None:
        if requested not in BACKENDS:
            raise LaunchError(
                f"unknown backend {requested!r}.", f"use one of {', '.join(BACKENDS)}."
            )
        if requested == "nccl" and device.type != "cuda":
            raise LaunchError(
                "backend 'nccl' needs GPUs but this process runs on the CPU.", "use backend='gloo'."
            )
        if requested == "nccl" and shared:
            raise LaunchError(
                "backend 'nccl' cannot run several processes on one GPU (--procs-per-gpu).",
                "leave backend unset (gloo is chosen) or give each process its own GPU.",
            )
        return requested
    return "nccl" if device.type == "cuda" and not shared else "gloo"


@dataclass(frozen=True)
class GroupSettings:
    backend: Optional[str] = None
    #: Collective timeout: a rank gone missing becomes an error after this, never a silent hang.
    timeout: timedelta = timedelta(minutes=30)
    #: How long the goodbye barrier waits for the others before giving up.
    teardown_timeout: timedelta = timedelta(seconds=60)
    #: How long joining waits for the other ranks, at least: their start-up (an import of torch, 3 s here
    #: and 30 s on a busy machine) is not a collective, and a short collective ``timeout`` must not turn it
    #: into a failure that depends on load. torchrun's agents wait 600 s to join, as here.
    join_timeout: timedelta = timedelta(seconds=600)


def group_active() -> bool:
    """Is a process group of more than one rank up? (The one test every helper asks.)"""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


#: After this long in the goodbye barrier a rank says what it waits for.
GOODBYE_NOTICE_S = 5.0


class DistSession:
    """Owns torch.distributed's default process group for one run: start once, close once (idempotent)."""

    def __init__(
        self, world: World, device: torch.device, settings: GroupSettings = GroupSettings()
    ) -> None:
        self.world = world
        self.device = device
        self.settings = settings
        self.backend = choose_backend(
            device, settings.backend, shared=world.processes_per_device > 1
        )
        self._started = False
        self._control: Any = None

    @property
    def control(self) -> Any:
        """A CPU (gloo) group for small control messages: stop flags, fingerprints, objects.

        With nccl the default group would need a GPU tensor and a host sync for each of them; with
        gloo the default group already is one (None means the default group to torch).
        """
        return self._control

    @property
    def active(self) -> bool:
        return self._started and dist.is_initialized()

    def start(self) -> "DistSession":
        """Join the other ranks. World size 1 starts no group: there is nobody to talk to."""
        if not self.world.is_distributed or self._started:
            return self
        if dist.is_initialized():
            raise LaunchError(
                "torch.distributed is already initialised in this process.",
                "call mg.init() instead of init_process_group(), not both, or call run.close() first.",
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        world, join = self.world, max(self.settings.timeout, self.settings.join_timeout)
        kwargs: dict[str, Any] = dict(
            backend=self.backend,
            rank=world.rank,
            world_size=world.world_size,
            timeout=self.settings.timeout,
        )
        if self.backend == "nccl":
            # eager NCCL start: errors surface here, not at step 1
            kwargs["device_id"] = self.device
        try:
            if self.backend == "mpi":  # MPI finds its peers itself: no store
                dist.init_process_group(**kwargs)
            else:
                dist.init_process_group(store=self._joined(join), **kwargs)
        # nobody came, a wrong address, a stale RANK/WORLD_SIZE in the shell
        except Exception as exc:
            text = " ".join(str(exc).split())
            raise LaunchError(
                f"rank {world.rank} could not join the other {world.world_size - 1} process(es) at "
                f"{world.master_addr}:{world.master_port} ({type(exc).__name__}: {text[:200]}).",
                "start every rank (multigpu run / torchrun / srun do), or unset stale RANK/WORLD_SIZE/MASTER_* "
                "variables in this shell.",
            ) from None
        self._started = True
        if self.backend != "gloo":
            self._control = dist.new_group(backend="gloo", timeout=self.settings.timeout)
        # the groups are made: the store's own waits get the collective timeout
        if self.backend != "mpi":
            dist.distributed_c10d._get_default_store().set_timeout(self.settings.timeout)
        return self

    def _joined(self, timeout: timedelta) -> Any:
        """The rendezvous store, once every rank has come to it (up to ``timeout``), under a prefix of this
        join's own: the group is then made by ranks that are all there."""
        world = self.world
        if world.agent_store:
            # The agent hosts the store and keeps it across restarts: keys of the previous attempt are
            # still there. A prefix per attempt keeps a restarted group from reading them.
            store = dist.PrefixStore(
                f"multigpu/attempt_{world.restart_count}",
                dist.TCPStore(
                    world.master_addr,
                    int(world.master_port or 0),
                    world.world_size,
                    is_master=False,
                    timeout=timeout,
                ),
            )
        # torchrun's agent or the user put MASTER_ADDR/PORT in the environment (env://), or tcp://
        else:
            url = (
                "env://"
                if world.source in ("torchrun", "env")
                else f"tcp://{_host(world.master_addr)}:{world.master_port}"
            )
            store = dist.PrefixStore(
                "default_pg",
                next(dist.rendezvous(url, world.rank, world.world_size, timeout=timeout))[0],
            )
        # The n-th rank to come to this store for this world size is in join (n - 1) // world_size: a second
        # mg.init in one process (after run.close()) is the next join, and a world grown on the same agent
        # store (torchrun's c10d: not a new attempt) counts afresh.
        size = world.world_size
        arrived = store.add(f"multigpu/arrived/w{size}", 1)
        join = f"w{size}_{(arrived - 1) // size}"
        if arrived % size == 0:  # the last one to come says so
            store.set(f"multigpu/all-arrived/{join}", "1")
        store.wait([f"multigpu/all-arrived/{join}"], timeout)
        return dist.PrefixStore(f"join_{join}", store)

    def barrier(self) -> None:
        if not self.active:
            return
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def close(self, goodbye: bool = True) -> None:
        """Barrier, destroy, flush: the order that keeps workers from aborting at interpreter exit.

        ``goodbye=False`` (leaving because of an error) skips the barrier: the other ranks are in some
        other collective and would only make this one wait. The barrier runs on the CPU control group
        with ``teardown_timeout``, also under nccl, so a missing rank costs seconds, not 30 minutes.
        """
        if not self.active:
            self._started = False
            return
        try:
            if goodbye:
                # A wait of more than a few seconds says what it waits for (the others may still be saving).
                notice = threading.Timer(
                    GOODBYE_NOTICE_S,
                    lambda: print(
                        f"multigpu: rank {self.world.rank} has finished and waits for the other ranks to finish too "
                        f"(up to {self.settings.teardown_timeout.total_seconds():.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    ),
                )
                notice.daemon = True
                notice.start()
                try:
                    dist.monitored_barrier(
                        group=self._control, timeout=self.settings.teardown_timeout
                    )
                finally:
                    notice.cancel()
        except Exception as exc:  # a peer already gone: still destroy our side
            warnings.warn(
                f"multigpu: goodbye barrier failed on rank {self.world.rank}: {' '.join(str(exc).split())[:200]}",
                stacklevel=2,
            )
        finally:
            dist.destroy_process_group()
            self._started = False
            self._control = None
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
