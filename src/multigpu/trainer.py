"""A short, readable fit/evaluate loop that composes strategy, precision, data and checkpoints.

Subclass and implement ``compute_loss`` (SpeechBrain's Brain and Lightning's LightningModule in one
method); optionally ``evaluate_batch`` for metrics. Everything else is settings: accumulation (with
no_sync), clipping, bf16/fp16, LR scheduler stepping, metrics averaged exactly across ranks, a rank-0
progress line with samples/s, a CSV per epoch, and automatic resume from the latest good checkpoint.

The loop is written so a reader can check it against a hand-written DDP loop line by line; the
benchmark ``benchmarks/overhead.py`` measures that it costs no more.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from multigpu.checkpoint import rng
from multigpu.data import Loader, describe_batch
from multigpu.diagnostics import consistency
from multigpu.diagnostics.watchdog import HangWatchdog
from multigpu.errors import ConfigError
from multigpu.metrics import MetricSums
from multigpu.precision import Precision
from multigpu.preemption import Preempted, StopSignal, requeue_slurm_job
from multigpu.progress import ProgressLine, read_csv, write_csv
from multigpu.runtime import Run
from multigpu.strategies.base import OptimizerLike

SchedulerLike = Union[Any, Callable[[torch.optim.Optimizer], Any], None]


@dataclass
class TrainerSettings:
    """Everything the loop does besides your ``compute_loss``; each field can come from a YAML file."""

    epochs: int = 1
    #: Stop after this many optimizer steps, even inside an epoch (None: run every epoch).
    max_steps: Optional[int] = None
    batch_size: int = 32  # per process: the global batch is batch_size x processes x accumulate
    eval_batch_size: Optional[int] = None
    accumulate: int = 1
    clip_grad_norm: Optional[float] = None
    precision: str = "32"
    strategy: Optional[str] = None  # None: the one given to mg.init() ("auto" unless said otherwise)
    strategy_options: dict = field(default_factory=dict)
    scheduler_interval: str = "step"  # or "epoch"
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    num_workers: int = 0
    out_dir: str = "outputs"
    checkpoint_every_epochs: int = 1
    checkpoint_every_steps: Optional[int] = None
    keep_last: int = 2
    resume: bool = True
    verify_checksums: bool = True
    progress: bool = True
    #: Stop cleanly on SIGTERM/SIGUSR1: finish the step, checkpoint, exit 75 (requeue under Slurm on USR1).
    preemption: bool = True
    #: Write where every rank is stuck and exit when no step finishes for this long (None: off).
    hang_timeout_s: Optional[float] = 900.0
    #: Compare model, settings, data and versions across ranks before training; fail with a diff.
    check_consistency: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.accumulate >= 1, "accumulate", "1 or more"),
            (self.epochs >= 0, "epochs", "0 or more"),
            (self.max_steps is None or self.max_steps >= 0, "max_steps", "0 or more, or null"),
            (self.batch_size >= 1, "batch_size", "1 or more (it is per process)"),
            (self.scheduler_interval in ("step", "epoch"), "scheduler_interval", "'step' or 'epoch'"),
            (self.keep_last >= 1, "keep_last", "1 or more"),
            (self.checkpoint_every_epochs >= 1, "checkpoint_every_epochs", "1 or more"),
            (self.clip_grad_norm is None or self.clip_grad_norm > 0, "clip_grad_norm", "positive or null"),
            (self.hang_timeout_s is None or self.hang_timeout_s > 0, "hang_timeout_s", "positive seconds or null"),
            (self.checkpoint_every_steps is None or self.checkpoint_every_steps >= 1, "checkpoint_every_steps",
             "1 or more, or null"),
        ]
        for ok, name, wanted in checks:
            if not ok:
                raise ConfigError(f"trainer setting {name}={getattr(self, name)!r} is invalid.", f"use {wanted}.")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "TrainerSettings":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown trainer setting {unknown[0]!r}.", f"known settings: {', '.join(sorted(known))}.")
        return cls(**dict(values))


@dataclass
class TrainState:
    epoch: int = 0  # the epoch in progress (or next to start)
    batch_in_epoch: int = 0  # batches of that epoch already trained on
    global_step: int = 0  # optimizer steps taken


def move_to(batch: Any, device: torch.device) -> Any:
    """Tensors inside tuples, lists and dicts, moved to ``device`` (non-blocking from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: move_to(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(move_to(v, device) for v in batch)
    if hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to(v, device) for v in batch))
    return batch


def batch_length(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else []
    for value in values:
        n = batch_length(value)
        if n:
            return n
    return 0


class Trainer(abc.ABC):
    """Subclass, implement ``compute_loss(batch) -> loss``, call ``fit(train_set, valid_set)``."""

    def __init__(self, run: Run, model: nn.Module, optimizer: OptimizerLike,
                 scheduler: SchedulerLike = None, settings: Optional[TrainerSettings] = None,
                 config: Any = None, **overrides: Any) -> None:
        """``config``: your recipe's own settings (any dataclass or mapping); ranks must agree on it."""
        base = dataclasses.asdict(settings) if settings is not None else {}
        self.settings = TrainerSettings.from_mapping({**base, **overrides})
        self.run = run
        self.device = run.device
        self.precision = Precision(self.settings.precision, self.device)
        if self.settings.check_consistency:  # before DDP wraps the model: our diff, not DDP's shape error
            consistency.check_same_on_all_ranks({
                **consistency.model_fingerprint(model),
                "trainer_settings": consistency.config_hash(dataclasses.asdict(self.settings)),
                "recipe_config": consistency.config_hash(_plain(config)),
                **consistency.environment_fingerprint(),
            }, group=run.group.control)
        self.model, self.optimizer = run.setup(model, optimizer, strategy=self.settings.strategy or run.strategy_name,
                                               **self.settings.strategy_options)
        if self.optimizer is None:
            raise ConfigError("the Trainer needs an optimizer.", "pass one, or a factory like "
                              "`lambda params: torch.optim.AdamW(params, lr=1e-3)`.")
        self.strategy = run.strategy
        if (scheduler is not None and not callable(scheduler) and isinstance(optimizer, torch.optim.Optimizer)
                and self.optimizer is not optimizer):
            raise ConfigError(f"strategy {self.strategy.name!r} rebuilt the optimizer on its sharded parameters, so "
                              "the scheduler given still drives the old one.",
                              "pass a scheduler factory: scheduler=lambda optimizer: CosineAnnealingLR(optimizer, ...).")
        self.scheduler = scheduler(self.optimizer) if callable(scheduler) else scheduler  # a factory or an instance
        self.state = TrainState()
        self.history: list[dict[str, Any]] = []
        self.out_dir = Path(self.settings.out_dir)
        self.checkpoint_dir = self.out_dir / "checkpoints"
        self.progress = ProgressLine(enabled=self.settings.progress and run.is_main)
        self._csv_rows: Optional[list] = None
        self._stop: Optional[StopSignal] = None
        self._watchdog: Optional[HangWatchdog] = None

    # ------------------------------------------------------------------ your code
    @abc.abstractmethod
    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The loss of one batch (already on ``self.device``), averaged over its samples."""

    def evaluate_batch(self, batch: Any) -> Mapping[str, tuple[Any, Any]]:
        """Metric *sums* and counts for one evaluation batch: ``{"accuracy": (correct, n)}``.

        Sums and counts (not means) make the result over several processes exact. The default is the
        loss, weighted by the batch size.
        """
        n = batch_length(batch)
        return {"loss": (self.compute_loss(batch).detach() * n, n)}

    def on_epoch_end(self, epoch: int, metrics: Mapping[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Called on every rank after each epoch's evaluation, with the global metrics."""

    # ------------------------------------------------------------------ loops
    def fit(self, train: Any, valid: Any = None, epochs: Optional[int] = None) -> list[dict[str, Any]]:
        s = self.settings
        epochs = s.epochs if epochs is None else epochs
        train_loader = self._as_loader(train, evaluation=False)
        valid_loader = self._as_loader(valid, evaluation=True) if valid is not None else None
        self.run.print("multigpu: " + describe_batch(train_loader.batch_size, self.run.world_size, s.accumulate,
                                                     len(train_loader.dataset)))
        if s.check_consistency:
            consistency.check_same_on_all_ranks(
                {"train_samples": len(train_loader.dataset), "batch_size": train_loader.batch_size,
                 "valid_samples": len(valid_loader.dataset) if valid_loader is not None else None,
                 "epochs": epochs}, group=self.run.group.control)
        if s.resume:
            self.resume()
        elif self.run.latest_checkpoint(self.checkpoint_dir, checksums=False) is not None:
            raise ConfigError(f"{self.checkpoint_dir} holds checkpoints of an earlier run and resume is off.",
                              "set resume: true to continue that run, or choose a new out_dir.")
        train_loader.resume_at(self.state.epoch, self.state.batch_in_epoch)
        self._stop = StopSignal(self.run.group.control, self.run.group.active).install() if s.preemption else None
        self._watchdog = (HangWatchdog(s.hang_timeout_s, self.out_dir / "hang", self.run.rank, self.run.world_size).start()
                          if s.hang_timeout_s else None)
        try:
            self._fit_epochs(train_loader, valid_loader, epochs)
        finally:
            if self._stop is not None:
                self._stop.uninstall()
            if self._watchdog is not None:
                self._watchdog.stop()
            self._stop = self._watchdog = None
        return self.history

    def _fit_epochs(self, train_loader: Loader, valid_loader: Optional[Loader], epochs: int) -> None:
        s = self.settings
        for epoch in range(self.state.epoch, epochs):
            if self._steps_done():
                break
            started = time.monotonic()
            train_metrics, samples = self._train_epoch(train_loader, epoch, epochs)
            elapsed = time.monotonic() - started
            valid_metrics = self.evaluate(valid_loader) if valid_loader is not None else {}
            partial = self.state.batch_in_epoch < len(train_loader)  # max_steps stopped it inside the epoch
            if not partial:
                if self.scheduler is not None and s.scheduler_interval == "epoch":
                    self.scheduler.step()
                self.state = TrainState(epoch + 1, 0, self.state.global_step)
            done = self.state.batch_in_epoch / len(train_loader) if partial else 1
            row = {"epoch": round(epoch + done, 4), "step": self.state.global_step,
                   **{f"train_{k}": v for k, v in train_metrics.items()},
                   **{f"valid_{k}": v for k, v in valid_metrics.items()},
                   "lr": self.optimizer.param_groups[0]["lr"],
                   "samples_per_s": samples / elapsed if elapsed > 0 else 0.0, "epoch_s": elapsed}
            self._record(row)
            self.progress.epoch_done(epoch, epochs, {k: v for k, v in row.items() if k not in ("epoch", "step")})
            if partial:
                self.save()  # resumable from here with a larger max_steps
                break
            with self._watchdog.paused() if self._watchdog is not None else contextlib.nullcontext():
                self.on_epoch_end(epoch, row)
            if (epoch + 1) % s.checkpoint_every_epochs == 0 or epoch + 1 == epochs:
                self.save()

    def _train_epoch(self, loader: Loader, epoch: int, epochs: int) -> tuple[dict[str, float], int]:
        s = self.settings
        model, optimizer, precision, strategy = self.model, self.optimizer, self.precision, self.strategy
        model.train()
        total = len(loader)  # the whole epoch: a resumed pass skips its first batches only once it starts
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = 0
        samples = 0
        started = time.monotonic()
        for index, batch in enumerate(loader, start=self.state.batch_in_epoch):
            batch = move_to(batch, self.device)
            boundary = (index + 1) % s.accumulate == 0 or index + 1 == total
            with (contextlib.nullcontext() if boundary else strategy.no_sync(model)):
                with precision.autocast():
                    loss = self.compute_loss(batch)
                strategy.backward(precision.scale(loss / s.accumulate if s.accumulate > 1 else loss))
            loss_sum += loss.detach()
            batches += 1
            samples += batch_length(batch)
            if boundary:
                precision.unscale(optimizer)
                if s.clip_grad_norm is not None:
                    strategy.clip_grad_norm(model, s.clip_grad_norm)
                stepped = precision.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                if stepped and self.scheduler is not None and s.scheduler_interval == "step":
                    self.scheduler.step()
                self.state.global_step += 1
            self.state.batch_in_epoch = index + 1
            if self.progress.wants_update():
                rate = samples * self.run.world_size / max(time.monotonic() - started, 1e-9)
                self.progress.update(epoch, epochs, index + 1, total, (loss_sum / batches).item(), rate)
            if self._watchdog is not None:
                self._watchdog.beat(self.state.global_step)
            if boundary and s.checkpoint_every_steps and self.state.global_step % s.checkpoint_every_steps == 0:
                self.save()
            if boundary and self._stop is not None and self._stop.poll():
                self._preempt()
            if boundary and self._steps_done():
                break
        metrics = MetricSums(self.run.comm_device)
        metrics.add("loss", loss_sum, batches)
        return metrics.compute(), samples * self.run.world_size

    def _steps_done(self) -> bool:
        return self.settings.max_steps is not None and self.state.global_step >= self.settings.max_steps

    def _preempt(self) -> None:
        """Every rank agreed to stop at this step: checkpoint it, requeue under Slurm on USR1, exit 75."""
        reason = self._stop.describe()
        path = self.save()
        if self.run.is_main and self._stop.received is not None:
            requeued = requeue_slurm_job(self.run.world.slurm_job_id, self._stop.received)
            if requeued:
                self.run.print(f"multigpu: requeued Slurm job {self.run.world.slurm_job_id}")
        self.run.print(f"multigpu: stopped by {reason} after step {self.state.global_step}; "
                       f"checkpoint {path} - run the same command again to resume")
        raise Preempted(f"preempted by {reason}; resume from {path}")

    @torch.no_grad()
    def evaluate(self, data: Any) -> dict[str, float]:
        """Global metrics over ``data`` (a dataset or an eval loader); exact across any number of ranks.

        Evaluation shards differ in length by up to one batch. Replicated models are evaluated without
        their DDP wrapper (whose forward may broadcast buffers - a collective the ranks would not all
        join); sharded ones need every rank's forward, so the ranks with fewer batches repeat one whose
        results are dropped.
        """
        loader = self._as_loader(data, evaluation=True)
        wrapped = self.model
        sharded_model = self.strategy.sharded
        self.model = wrapped if sharded_model else self.strategy.unwrap(wrapped)
        self.model.eval()
        sums = MetricSums(self.run.comm_device)
        extra = self._missing_batches(len(loader)) if sharded_model else 0
        try:
            last = None
            for batch in loader:
                last = move_to(batch, self.device)
                with self.precision.autocast():
                    sums.update(self.evaluate_batch(last))
                if self._watchdog is not None:
                    self._watchdog.beat(self.state.global_step)
            for _ in range(extra):  # keep FSDP's all-gathers paired across ranks; results dropped
                with self.precision.autocast():
                    self.evaluate_batch(last)
        finally:
            self.model = wrapped
            self.model.train()
        return sums.compute()

    def _missing_batches(self, mine: int) -> int:
        if not self.run.group.active:
            return 0
        most = torch.tensor([mine])
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.run.group.control)
        if mine == 0 and most.item() > 0:
            raise ConfigError("a sharded model needs every rank to evaluate at least one batch.",
                              "use an evaluation set with at least as many samples as processes.")
        return int(most.item()) - mine

    def _as_loader(self, data: Any, evaluation: bool) -> Loader:
        if isinstance(data, Loader):
            return data
        s = self.settings
        if evaluation:
            return self.run.eval_loader(data, s.eval_batch_size or s.batch_size, num_workers=s.num_workers)
        return self.run.loader(data, s.batch_size, shuffle=s.shuffle, seed=s.seed, drop_last=s.drop_last,
                               num_workers=s.num_workers, quiet=True)

    def _record(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        if self.run.is_main:
            path = self.out_dir / "metrics.csv"
            if self._csv_rows is None:  # first epoch of this process: keep the rows of earlier runs
                self._csv_rows = [r for r in read_csv(path) if float(r.get("epoch", 0)) < row["epoch"]]
            self._csv_rows.append(row)
            write_csv(path, self._csv_rows)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the model and optimizer (as objects: the run saves them
        in the strategy's format), scheduler, scaler, counters and data layout. Extend it to save more."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.precision.state_dict(),
            "trainer": dataclasses.asdict(self.state),
            "data": {"batch_size": self.settings.batch_size, "world_size": self.run.world_size,
                     "seed": self.settings.seed},
        }

    def save(self) -> Path:
        """Write a checkpoint of the current state (every rank calls it; returns once it exists)."""
        state = self.checkpoint_state()
        state["rng"] = self._gather_rng()  # every rank's generators, held by rank 0
        meta = {"epoch": self.state.epoch}
        with self._watchdog.paused() if self._watchdog is not None else contextlib.nullcontext():
            return self.run.save_checkpoint(self.checkpoint_dir, self.state.global_step, state,
                                            keep_last=self.settings.keep_last, meta=meta)

    def _gather_rng(self) -> list[dict]:
        mine = rng.capture()
        if not self.run.group.active:
            return [mine]
        gathered: list[Any] = [None] * self.run.world_size if self.run.is_main else None
        dist.gather_object(mine, gathered, dst=0, group=self.run.group.control)
        return gathered if self.run.is_main else []

    def resume(self) -> bool:
        """Load the newest checkpoint that verifies, if any; corrupt ones are reported and skipped."""
        info = self.run.latest_checkpoint(self.checkpoint_dir, checksums=self.settings.verify_checksums)
        if info is None:
            return False
        state = self.run.load_checkpoint(info, self.model, self.optimizer)
        self.load_checkpoint_state(state or {})
        self.run.print(f"multigpu: resumed from {info.path} (epoch {self.state.epoch}, "
                       f"batch {self.state.batch_in_epoch}, step {self.state.global_step})")
        return True

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restore the rest of ``checkpoint_state()`` (the run already restored model and optimizer)."""
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("scaler") or {})
        self.state = TrainState(**state["trainer"])
        self._realign_batches(state.get("data", {}))
        rng_states = state.get("rng") or []
        if len(rng_states) == self.run.world_size:
            rng.restore(rng_states[self.run.rank])
        elif rng_states:
            warnings.warn(f"multigpu: the checkpoint holds RNG states of {len(rng_states)} rank(s), this run has "
                          f"{self.run.world_size}; random streams restart from rank 0's.", stacklevel=2)
            rng.restore(rng_states[0])

    def _realign_batches(self, data: Mapping[str, Any]) -> None:
        """Resuming mid-epoch with another world size or batch: continue after the same global sample."""
        if not self.state.batch_in_epoch or not data:
            return
        old_global = data["batch_size"] * data["world_size"]
        new_global = self.settings.batch_size * self.run.world_size
        if old_global == new_global:
            return
        done = self.state.batch_in_epoch * old_global
        self.state.batch_in_epoch = done // new_global
        if done % new_global:
            warnings.warn(f"multigpu: resuming mid-epoch with global batch {new_global} (was {old_global}); "
                          f"{done % new_global} sample(s) of this epoch are seen twice.", stacklevel=2)



def _plain(config: Any) -> Any:
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config


__all__ = ["Trainer", "TrainerSettings", "TrainState", "move_to", "batch_length"]
