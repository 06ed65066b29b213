"""``mg.init()``: the one call at the top of a training script, and the :class:`Run` it returns.

Why: the script should not care whether torchrun, Slurm, ``multigpu run`` or nobody started it.
``init`` reads the world (and the job's requests) once, picks this process's device(s) and backend,
starts the process group with a finite timeout, and owns teardown (registered at exit). The ``Run``
composes the pieces a script needs - strategy, data, checkpoints, and the same safety a Trainer has
(hang watchdog, preemption agreement, consistency check) for a hand-written loop - and holds no
global state, so two runs in one process (sequentially, or in tests) do not interfere.

The Run is a facade: what it does is in the rooms it delegates to, one line per method - the
strategy (``strategies``), data (``data``), the checkpoint choreography (``checkpoint.manager``), the
loop's safety (``guards``: watchdog, preemption, interrupts) and metrics. Leaving by an interrupt: once
this rank has seen Ctrl-C (or left ``fit`` by an exception), every collective of the Run refuses at once
with a one-line error instead of waiting for partners that are not coming.
"""

from __future__ import annotations

import atexit
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from multigpu import metrics
from multigpu.checkpoint.io import CheckpointIO, choose_io
from multigpu.checkpoint.manager import CheckpointManager
from multigpu.checkpoint.rng import seed_everything
from multigpu.data.adapt import adapt
from multigpu.data.samplers import describe_batch
from multigpu.distributed import rank_zero
from multigpu.distributed.agreement import Pending
from multigpu.distributed.job import Job
from multigpu.distributed.parallel import Parallelism, check_replica_groups
from multigpu.distributed.session import DistSession
from multigpu.distributed.world import World
from multigpu.errors import ConfigError, visible
from multigpu.fileio import inside
from multigpu.guards import Guards, GuardSettings, consistency, interrupt, probe as check_probe
from multigpu.runtime.checkpoints import Checkpoints
from multigpu.strategies import Strategy, make_strategy
from multigpu.strategies.base import OptimizerLike

T = TypeVar("T")


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s random streams after setup: different per rank, reproducible."""
    return (seed * 1_000_003 + 7919 * (rank + 1)) % (2**63)


@dataclass(eq=False)  # compared and hashed by identity: it is a live object, not a value
class Run(Checkpoints):
    """One training job as seen from this process."""

    world: World
    devices: list[torch.device]
    session: DistSession
    # what the command that started it asks (queue folder, check, profile)
    job: Job = field(default_factory=Job)
    #: Strategy name used by ``setup`` when it is not given there ("auto": ddp if several processes).
    strategy_name: str = "auto"
    strategy: Optional[Strategy] = None
    parallelism: Optional[Parallelism] = None
    #: The seed given to init (None: not seeded); ``same_random_streams``: keep every rank's streams equal.
    seed: Optional[int] = None
    same_random_streams: bool = False
    #: ``multigpu check``'s recorder (None unless the check started this process).
    probe: Any = field(default=check_probe.NO_PROBE, repr=False)
    #: The loop's safety: watchdog, preemption agreement, interrupts (built from the session).
    guards: Guards = field(init=False, repr=False)
    _checkpoints: CheckpointManager = field(init=False, repr=False)
    _mesh: Any = field(default=None, repr=False)
    _dp_group: Any = field(default=None, repr=False)
    _loaders_dp: Optional[int] = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.parallelism is None:
            self.parallelism = Parallelism.plain(self.world.world_size)
        self.guards = Guards(self.session, self.job.trial_dir)
        self._checkpoints = CheckpointManager(
            self.session, lambda: self.checkpoint_io, self.guards.paused, self.print
        )

    # ------------------------------------------------------------------ where am I
    @property
    def device(self) -> torch.device:
        """The first (usually only) device of this process: put your batches here."""
        return self.devices[0]

    @property
    def backend(self) -> str:
        return self.session.backend

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

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank reads (ranks of one tensor-parallel group read the same); with replica
        groups, numbered across every group."""
        return self.world.replica_group * self.degrees.dp_size + self.degrees.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        """How many different shards the data is split into: the global batch is batch x dp_size (with
        replica groups: while every group is alive)."""
        return self.degrees.dp_size * self.world.replica_groups

    @property
    def control_group(self) -> Any:
        """The CPU (gloo) group for small control messages (None: the default group, already gloo)."""
        return self.session.control

    # ------------------------------------------------------------------ parallelism
    def configure_parallelism(
        self,
        *,
        tp: int = 1,
        dp_replicate: int = 1,
        dp_shard: Optional[int] = None,
        pp: int = 1,
        fault_tolerance: Optional[Mapping[str, int]] = None,
    ) -> Parallelism:
        """Set the degrees (before ``setup`` and before any loader): their product is the world size.
        ``fault_tolerance`` (replica groups, the Trainer's setting) is checked against the launch."""
        check_replica_groups(fault_tolerance, self.world)
        wanted = Parallelism.from_degrees(
            self.world_size,
            self.world.local_world_size,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            tp=tp,
            pp=pp,
        )
        if wanted == self.parallelism:
            return wanted
        if self.strategy is not None or self._mesh is not None:
            raise ConfigError(
                "the parallelism degrees changed after the model was set up.",
                "give tp/dp_replicate/pp to mg.init() or before run.setup().",
            )
        if self._loaders_dp is not None and self._loaders_dp != wanted.dp_size:
            raise ConfigError(
                f"loaders were built for {self._loaders_dp} data shards, but tp={tp}, "
                f"dp_replicate={dp_replicate}, pp={pp} make {wanted.dp_size}.",
                "set the degrees (mg.init(tp=...) or the Trainer settings) before building loaders.",
            )
        self.parallelism = wanted
        return wanted

    @property
    def degrees(self) -> Parallelism:
        """``parallelism``, never None once constructed (plain data parallelism unless given)."""
        if self.parallelism is None:
            raise RuntimeError(
                "Run.parallelism is None: it is set at construction and by configure_parallelism"
            )
        return self.parallelism

    @property
    def mesh(self) -> Any:
        """The job's DeviceMesh over (dp_replicate, dp_shard, tp), built on first use (a collective)."""
        if self._mesh is None:
            self._ensure_usable("building the device mesh")
            self._mesh = self.degrees.build_mesh(self.device.type)
        return self._mesh

    @property
    def dp_group(self) -> Any:
        """The data-parallel group of this rank (None: every rank, the default group)."""
        return self._dp_group

    def _make_dp_groups(self) -> None:
        """With tensor or pipeline parallelism, metrics reduce over the ranks holding different data only (of
        one stage). Every rank creates every group, in the same order (torch's rule for new_group)."""
        par = self.degrees
        if (par.tp == 1 and par.pp == 1) or self._dp_group is not None or not self.session.active:
            return
        for ranks in par.dp_groups():
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self._dp_group = group

    # ------------------------------------------------------------------ model, data, metrics
    def setup(
        self,
        model: nn.Module,
        optimizer: OptimizerLike = None,
        *,
        strategy: Optional[str] = None,
        **options: Any,
    ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        """Wrap ``model`` for the strategy (default: the one given to ``init``) and bind the optimizer.

        ``optimizer``: an optimizer, or a factory ``params -> optimizer`` (needed by sharded strategies,
        which replace the parameters). Returns ``(model, optimizer)`` to use from here on. After this,
        if ``init`` was given a seed, every rank's random streams (dropout, augmentation) differ.
        """
        self._ensure_usable("setting up the model")
        self.strategy = make_strategy(
            strategy or self.strategy_name,
            self.world,
            self.devices,
            parallelism=self.parallelism,
            mesh=lambda: self.mesh,
            **options,
        )
        wrapped = self.strategy.setup(model, optimizer)
        self._make_dp_groups()
        self.probe.attach(self, wrapped[0], self.strategy.unwrap(wrapped[0]), wrapped[1])
        if self.seed is not None and not self.same_random_streams:
            seed_everything(rank_seed(self.seed, self.world.global_rank))
        return wrapped

    def _need_strategy(self) -> Strategy:
        if self.strategy is None:
            self.strategy = make_strategy(
                self.strategy_name,
                self.world,
                self.devices,
                parallelism=self.parallelism,
                mesh=lambda: self.mesh,
            )
        return self.strategy

    def loader(
        self,
        data: Any,
        batch_size: Optional[int] = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        quiet: bool = False,
        **dataloader_kwargs: Any,
    ) -> Any:
        """Training loader over this rank's share of ``data`` - a Dataset, your own DataLoader (rebuilt
        with its settings), or an IterableDataset. ``batch_size`` is per data-parallel rank (a
        DataLoader keeps its own). Reshuffles each epoch by itself."""
        loader = self._adapt(
            data,
            batch_size,
            evaluation=False,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            **dataloader_kwargs,
        )
        if not quiet:
            self.print(f"multigpu: {self.describe_batch(loader.batch_size, length=loader.samples)}")
        return loader

    def eval_loader(
        self, data: Any, batch_size: Optional[int] = None, **dataloader_kwargs: Any
    ) -> Any:
        """Evaluation loader: every sample exactly once across ranks (no padding), in a fixed order -
        rank r of W reads samples r, r+W, r+2W, ... (``gather_in_order`` puts them back in order)."""
        return self._adapt(data, batch_size, evaluation=True, shuffle=False, **dataloader_kwargs)

    def _adapt(
        self, data: Any, batch_size: Optional[int], *, evaluation: bool, **options: Any
    ) -> Any:
        from torch.utils.data import DataLoader

        if (
            batch_size is None
            and not isinstance(data, DataLoader)
            and not hasattr(data, "batch_size")
        ):
            raise ConfigError(
                "a loader needs batch_size (per data-parallel rank).", "e.g. run.loader(data, 32)."
            )
        self._loaders_dp = self.dp_size
        scale = self.probe.batch_scale(evaluation)
        # Evaluation stays inside a replica group: each group evaluates every sample with the same weights
        # (identical metrics in every group, no collective across groups that a dead group could stall).
        dp_rank, dp_size = (
            (self.degrees.dp_rank(self.rank), self.degrees.dp_size)
            if evaluation
            else (self.dp_rank, self.dp_size)
        )
        loader = adapt(
            data,
            dp_rank=dp_rank,
            dp_size=dp_size,
            batch_size=batch_size or 1,
            evaluation=evaluation,
            batch_scale=scale,
            pin_memory=self.device.type == "cuda",
            rank_streams=not self.same_random_streams,
            agree=self._min_agreement,
            **options,
        )
        return self.probe.loader(loader, evaluation)

    def _min_agreement(self) -> Optional[Pending]:
        """A stream's end, agreed asynchronously: it ends on every rank where the shortest share ends."""
        if not self.session.active:
            return None
        return Pending(
            "min",
            self.control_group,
            before=lambda: self._ensure_usable("agreeing on the end of a stream"),
        )

    def describe_batch(
        self, batch_size: int, accumulation: int = 1, length: Optional[int] = None
    ) -> str:
        # replica groups: the global batch while every group is live
        if self.world.lighthouse is not None:
            return (
                describe_batch(batch_size, self.dp_size, accumulation, length)
                + f" while all {self.world.replica_groups} replica groups of {self.degrees.dp_size} are live"
            )
        if self.degrees.is_plain:
            return describe_batch(batch_size, self.dp_size, accumulation, length)
        return (
            describe_batch(
                batch_size, self.dp_size, accumulation, length, unit="data-parallel rank"
            )
            + f" ({self.world_size} processes: {self.degrees.describe()})"
        )

    def backward(self, loss: torch.Tensor) -> None:
        self.probe.record_loss(loss)
        self._need_strategy().backward(loss)

    def no_sync(self, model: nn.Module) -> Any:
        """Context for gradient-accumulation micro-steps: no gradient all-reduce inside it."""
        return self._need_strategy().no_sync(model)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return self._need_strategy().clip_grad_norm(model, max_norm)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self._need_strategy().unwrap(model)

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The model's full weights with plain names (no ``module.``/``_orig_mod.``), ready for a plain model.

        Sharded models are gathered to global rank 0 on the CPU - a collective: call it on every rank
        (the other ranks get an empty dict), not inside ``if run.is_main:``.
        """
        self._ensure_usable("gathering the model's weights")
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

    def metric_sums(self) -> metrics.MetricSums:
        """An accumulator of (sum, count) per metric whose ``compute()`` reduces over the data-parallel group."""
        return metrics.MetricSums(
            self.comm_device, group=self.dp_group, before_reduce=self._ensure_usable
        )

    def reduce(self, values: Mapping[str, tuple[Any, Any]]) -> dict[str, float]:
        """``{"accuracy": (correct, count), ...}`` on each rank -> exact global ratios on every rank."""
        sums = self.metric_sums()
        sums.update(values)
        return sums.compute()

    def gather_in_order(self, local: torch.Tensor) -> torch.Tensor:
        """Per-sample outputs of an ``eval_loader`` pass, in dataset order, on every rank."""
        self._ensure_usable("gathering outputs")
        return metrics.gather_in_order(local.to(self.comm_device), group=self.dp_group)

    # ------------------------------------------------------------------ the same safety as the Trainer
    def check_consistency(self, model: nn.Module, config: Any = None, **values: Any) -> None:
        """Fail on every rank, with a diff, if ranks disagree on the model's layout, ``config``, ``values``
        or package versions. Call it before ``setup`` (before DDP would hang on a mismatch)."""
        self._ensure_usable("comparing ranks")
        consistency.check_same_on_all_ranks(
            {
                **consistency.model_fingerprint(model),
                **consistency.config_items("config", config),
                **{
                    k: v
                    for key, value in values.items()
                    for k, v in consistency.config_items(key, value).items()
                },
                **consistency.environment_fingerprint(),
            },
            group=self.control_group,
        )

    def configure_guards(self, **settings: Any) -> GuardSettings:
        """Change the watchdog and preemption settings (before the first ``step_done``/``should_stop``)."""
        return self.guards.configure(**settings)

    def step_done(self, step: int) -> None:
        """Call once per optimizer step: the hang watchdog's heartbeat (two attribute stores). The first
        call starts the watchdog: when no step finishes for ``hang_timeout_s`` it writes where every rank
        is stuck into ``report_dir`` and ends the job instead of hanging."""
        self.guards.step_done(step)

    def should_stop(self) -> bool:
        """Call once per optimizer step on every rank: True on every rank at the same step once any rank
        got SIGTERM/SIGUSR1 (a preemption). Then save a checkpoint and call ``run.exit_preempted(path)``.
        The first call installs the signal handlers (before it, SIGTERM ends the process as usual)."""
        return self.guards.should_stop()

    def exit_preempted(self, checkpoint_path: Any = None, step: Optional[int] = None) -> None:
        """After a stop agreed by ``should_stop`` and a checkpoint: requeue the Slurm job on SIGUSR1, exit 75."""
        self.guards.exit_preempted(self.print, checkpoint_path, step)

    def report(self, metric: Any, step: int) -> bool:
        """A sweep or search trial's one call after each evaluation, on every rank: ``metric`` (a number,
        or a mapping holding the search's metric) at optimizer ``step``. True on every rank once the
        queue's search pruned the trial: save a checkpoint and stop. Outside a queue trial: False, free."""
        return self.guards.report(metric, step, self.print)

    def paused_watchdog(self) -> Any:
        """No hang report while inside (a long checkpoint write, an evaluation hook)."""
        return self.guards.paused()

    def settle(self) -> None:
        """Wait for the outstanding stop agreement before a loader forks its worker processes."""
        self.guards.settle()

    def release_guards(self, clean: bool = True) -> None:
        """Stop the watchdog and restore the signal handlers (``clean=False``: leaving by an exception)."""
        self.guards.release(clean)

    def interrupted(self, reason: str) -> None:
        """Mark this rank as having left the lockstep (Ctrl-C, an exception out of ``fit``); this rank's own
        asynchronous checkpoint write finishes first (no other rank is asked)."""
        self._checkpoints.wait_quietly()
        self.guards.interrupt(reason)

    def _ensure_usable(self, doing: str = "a collective") -> None:
        self.guards.ensure_usable(doing)

    # ------------------------------------------------------------------ helpers
    def check_writable(self, folder: str | Path, what: str) -> Path:
        """``folder`` if this run may write there: under ``multigpu queue`` only inside the run's own
        folder (a runs file someone handed you cannot point a run at your home folder)."""
        if not inside(folder, self.job.run_dir):
            raise ConfigError(
                f"{what} {visible(str(folder))[:200]} is outside this queue run's folder "
                f"{visible(str(self.job.run_dir))[:200]}.",
                "write below the run's folder (the runs file's out_dir_key sets it), or start the "
                "script yourself instead of from that runs file.",
            )
        return Path(folder)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print on global rank 0 only."""
        rank_zero.print_on_main(self.world.is_main, *args, **kwargs)

    def run_on_main(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._ensure_usable(f"run_on_main({getattr(fn, '__name__', fn)})")
        return rank_zero.run_on_main(fn, *args, **kwargs)

    def barrier(self) -> None:
        self._ensure_usable("a barrier")
        self.session.barrier()

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Barrier, destroy the process group, flush. Safe to call twice; also runs at exit.

        When the process is leaving because of an uncaught exception (``sys.last_value`` is set, as
        Python and the worker wrapper do) or after an interrupt, the goodbye barrier is skipped: the
        others cannot join it.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        # an asynchronous checkpoint finishes before its process group goes
        self._checkpoints.wait_quietly()
        self.guards.release(clean=False)
        interrupt.remove(self.guards)
        self.session.close(
            goodbye=getattr(sys, "last_value", None) is None and not self.guards.interrupted_by
        )

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
