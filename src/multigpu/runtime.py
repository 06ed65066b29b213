"""``mg.init()``: the one call at the top of a training script, and the :class:`Run` it returns.

Why: the script should not care whether torchrun, Slurm, ``multigpu run`` or nobody started it.
``init`` reads the world once, picks this process's device(s) and backend, starts the process group
with a finite timeout, and owns teardown (registered at exit, so a script that forgets still exits
cleanly). The ``Run`` composes the pieces a script needs; it holds no global state, so two runs in one
process (sequentially, or in tests) do not interfere.
"""

from __future__ import annotations

import atexit
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, TypeVar

import torch

from torch import nn

from multigpu import checkpoint, helpers, metrics
from multigpu.checkpoint.io import CheckpointIO, choose_io
from multigpu.checkpoint.rng import seed_everything
from multigpu.data import Loader, describe_batch, make_loader
from multigpu.distributed import GroupSettings, ProcessGroup, choose_devices
from multigpu.strategies import Strategy, make_strategy
from multigpu.strategies.base import OptimizerLike
from multigpu.world import World, detect_world

T = TypeVar("T")


@dataclass
class Run:
    """One training job as seen from this process."""

    world: World
    devices: list[torch.device]
    group: ProcessGroup
    #: Strategy name used by ``setup`` when it is not given there ("auto": ddp if several processes).
    strategy_name: str = "auto"
    strategy: Optional[Strategy] = None
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

    # ------------------------------------------------------------------ model, data, metrics
    def setup(self, model: nn.Module, optimizer: OptimizerLike = None, *, strategy: Optional[str] = None,
              **options: Any) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        """Wrap ``model`` for the strategy (default: the one given to ``init``) and bind the optimizer.

        ``optimizer``: an optimizer, or a factory ``params -> optimizer`` (needed by sharded strategies,
        which replace the parameters). Returns ``(model, optimizer)`` to use from here on.
        """
        self.strategy = make_strategy(strategy or self.strategy_name, self.world, self.devices, **options)
        return self.strategy.setup(model, optimizer)

    def _need_strategy(self) -> Strategy:
        if self.strategy is None:
            self.strategy = make_strategy(self.strategy_name, self.world, self.devices)
        return self.strategy

    def loader(self, dataset: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
               drop_last: bool = False, quiet: bool = False, **dataloader_kwargs: Any) -> Loader:
        """Training loader over this rank's shard; ``batch_size`` is per process. Reshuffles each epoch."""
        loader = make_loader(dataset, batch_size, rank=self.rank, world_size=self.world_size, shuffle=shuffle,
                             seed=seed, drop_last=drop_last, pin_memory=self.device.type == "cuda",
                             **dataloader_kwargs)
        if not quiet:
            self.print(f"multigpu: {describe_batch(batch_size, self.world_size, length=len(dataset))}")
        return loader

    def eval_loader(self, dataset: Any, batch_size: int, **dataloader_kwargs: Any) -> Loader:
        """Evaluation loader: every sample exactly once across ranks (no padding), in a fixed order."""
        return make_loader(dataset, batch_size, rank=self.rank, world_size=self.world_size, evaluation=True,
                           pin_memory=self.device.type == "cuda", **dataloader_kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self._need_strategy().backward(loss)

    def no_sync(self, model: nn.Module) -> Any:
        """Context for gradient-accumulation micro-steps: no gradient all-reduce inside it."""
        return self._need_strategy().no_sync(model)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return self._need_strategy().clip_grad_norm(model, max_norm)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self._need_strategy().unwrap(model)

    def state_dict(self, model: nn.Module) -> dict:
        """The model's full weights with plain names (no ``module.``/``_orig_mod.``), ready for a plain model.

        Sharded models are gathered to global rank 0 on the CPU - a collective: call it on every rank
        (the other ranks get an empty dict), not inside ``if run.is_main:``.
        """
        return self.checkpoint_io.model_state(model)

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """How this run's checkpoints are written and read, from its strategy (one file, or DCP shards)."""
        strategy = self._need_strategy()
        return choose_io(strategy.sharded, self.is_main, self.barrier, strategy.unwrap)

    @property
    def comm_device(self) -> torch.device:
        """Where tensors for collectives must live: the GPU for nccl, the CPU otherwise."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def reduce(self, values: Mapping[str, tuple[Any, Any]]) -> dict[str, float]:
        """``{"accuracy": (correct, count), ...}`` on each rank -> exact global ratios on every rank."""
        return metrics.reduce_sums(values, self.comm_device)

    def gather_in_order(self, local: torch.Tensor) -> torch.Tensor:
        """Per-sample outputs of an ``eval_loader`` pass, in dataset order, on every rank."""
        return metrics.gather_in_order(local.to(self.comm_device))

    def seed(self, seed: int) -> None:
        """Seed python, numpy and torch the same on every rank (identical initial weights)."""
        seed_everything(seed)

    # ------------------------------------------------------------------ checkpoints (bring-your-own loop)
    def save_checkpoint(self, directory: str | Path, step: int, state: dict, keep_last: Optional[int] = None,
                        meta: Optional[dict] = None) -> Path:
        """Write ``state`` as an atomic, verified checkpoint; every rank calls this and returns after it exists.

        Put the model under ``"model"`` and the optimizer under ``"optimizer"``. Replicated strategies
        write one ``state.pt`` from rank 0 with a clean model state dict (loads into a plain model
        anywhere); sharded ones (fsdp) write DCP shards from every rank, loadable at any world size.
        ``keep_last``: delete all but the newest so many (checkpoints of later steps, left by a run
        that was abandoned, are moved aside, never deleted).
        """
        io = self.checkpoint_io
        model, optimizer = state.get("model"), state.get("optimizer")
        rest = {k: (v.state_dict() if hasattr(v, "state_dict") and not isinstance(v, nn.Module) else v)
                for k, v in state.items() if k not in ("model", "optimizer")}
        meta = {"world_size": self.world_size, "strategy": self._need_strategy().name, **(meta or {})}
        path = io.save(Path(directory), step, model if isinstance(model, nn.Module) else None, optimizer, rest, meta)
        if self.is_main:
            for moved in checkpoint.prune(directory, keep_last, newest=step):
                if moved.name.startswith("abandoned-"):
                    self.print(f"multigpu: moved {moved.name[len('abandoned-'):]} aside to {moved} "
                               f"(a later step than the one just saved: left by an abandoned run)")
        self.barrier()
        return path

    def latest_checkpoint(self, directory: str | Path, checksums: bool = True) -> Optional[checkpoint.CheckpointInfo]:
        """The newest checkpoint that verifies, chosen by rank 0 and the same on every rank.

        Rank 0 alone reads and checks the files (each skipped one is reported); the others take its
        choice, so ranks never pick different steps from a lagging shared-filesystem listing.
        """
        info = checkpoint.latest(directory, checksums=checksums, report=self.print) if self.is_main else None
        if not self.group.active:
            return info
        import torch.distributed as dist

        box = [None if info is None else (str(info.path), info.step, info.meta)]
        dist.broadcast_object_list(box, src=0, group=self.group.control)
        if box[0] is None:
            return None
        path, step, manifest = box[0]
        return checkpoint.CheckpointInfo(Path(path), step, manifest)

    def load_checkpoint(self, where: "str | Path | checkpoint.CheckpointInfo", model: Optional[nn.Module] = None,
                        optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[dict]:
        """Load a checkpoint: ``where`` is a ``step-N`` folder, a folder of them (the newest good one), or
        what ``latest_checkpoint`` returned (already verified).

        With ``model``/``optimizer`` their states are restored in place, whatever the checkpoint's world
        size; the rest of the saved dict is returned. None when there is no checkpoint. A folder is
        verified against its manifest first, and read the way this run's strategy reads checkpoints.
        """
        if isinstance(where, checkpoint.CheckpointInfo):
            return self.checkpoint_io.load(where.path, where.meta, model, optimizer, self.device)
        path = Path(where)
        if not (path / checkpoint.files.MANIFEST).exists():
            info = self.latest_checkpoint(path)
            if info is None:
                return None
            path, manifest = info.path, info.meta
        else:
            manifest = checkpoint.verify(path)
        return self.checkpoint_io.load(path, manifest, model, optimizer, self.device)

    # ------------------------------------------------------------------ helpers
    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print on global rank 0 only."""
        if self.world.is_main:
            kwargs.setdefault("flush", True)
            print(*args, **kwargs)

    def run_on_main(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return helpers.run_on_main(fn, *args, **kwargs)

    def barrier(self) -> None:
        self.group.barrier()

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Barrier, destroy the process group, flush. Safe to call twice; also runs at exit.

        When the process is leaving because of an uncaught exception (``sys.last_value`` is set, as
        Python and the worker wrapper do) the goodbye barrier is skipped: the others cannot join it.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.group.close(goodbye=getattr(sys, "last_value", None) is None)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def init(
    *,
    backend: Optional[str] = None,
    timeout_s: float = 1800.0,
    accelerator: str = "auto",
    strategy: str = "auto",
    seed: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
) -> Run:
    """Find where this process stands and join the others.

    ``backend``: nccl for GPUs and gloo for CPUs unless given. ``timeout_s``: how long a collective may
    wait for a missing rank before it fails (instead of hanging). ``accelerator``: 'auto', 'cuda' or
    'cpu'. ``strategy``: what ``run.setup`` wraps models with (auto, single, dp, ddp, fsdp, pipeline,
    ddp+pipeline). ``seed``: seed every generator the same on all ranks. ``env``: read this mapping
    instead of the process environment (tests).
    """
    world = detect_world(env)
    cuda_count = torch.cuda.device_count() if accelerator != "cpu" else 0
    devices = choose_devices(world, cuda_count, accelerator)
    settings = GroupSettings(backend=backend, timeout=timedelta(seconds=timeout_s))
    group = ProcessGroup(world, devices[0], settings).start()
    run = Run(world=world, devices=devices, group=group, strategy_name=strategy)
    atexit.register(run.close)
    if seed is not None:
        seed_everything(seed)
    return run
