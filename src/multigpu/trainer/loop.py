"""A short, readable fit/evaluate loop that composes strategy, precision, data, checkpoints and logging.

Subclass and implement ``compute_loss`` (SpeechBrain's Brain and Lightning's LightningModule in one
method); optionally ``evaluate_batch`` for metrics and a few hooks. Everything else is settings:
accumulation (with no_sync), clipping, bf16/fp16, ``torch.compile``, LR scheduler stepping, metrics
averaged exactly across ranks, loggers (CSV, TensorBoard, W&B, MLflow), validation inside an epoch,
the best checkpoint and early stopping, a rank-0 progress line with an ETA, and automatic resume from
the latest good checkpoint - with the run's safety on: hang watchdog, preemption agreement,
consistency check (the same ones a hand-written loop gets from :class:`~multigpu.runtime.Run`).

Hooks, in the order they are called (epochs count from 1, as in the progress line and the logs)::

    on_fit_start()
      on_epoch_start(epoch)
        on_train_batch_end(step, loss)          every batch; loss is a tensor (no forced sync)
        [every eval_every_steps steps: on_evaluate_start(), on_validation_end(metrics)]
      on_evaluate_start(); on_validation_end(metrics)      after the epoch, when there is valid data
      on_epoch_end(epoch, metrics)
      on_checkpoint(path)                        after each checkpoint is written (also the best one)
    on_fit_end()

The loop is written so a reader can check it against a hand-written DDP loop line by line;
``benchmarks/peers.py`` measures that it costs no more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from multigpu.data import LoaderLike
from multigpu.errors import ConfigError
from multigpu.guards import consistency
from multigpu.guards.preemption import Preempted
from multigpu.loggers import Loggers, hparams_of
from multigpu.runtime import Run
from multigpu.strategies.base import OptimizerLike
from multigpu.trainer import checkpoints, identity, replicas, reports, validation
from multigpu.trainer.batches import batch_length, move_to
from multigpu.trainer.extras import StepExtras
from multigpu.trainer.hooks import Hooks
from multigpu.trainer.monitor import BestTracker
from multigpu.trainer.precision import Precision
from multigpu.trainer.progress import ProgressLine, show_progress
from multigpu.trainer.settings import TrainerSettings, TrainState
from multigpu.trainer.step import make_step

SchedulerLike = Union[Any, Callable[[torch.optim.Optimizer], Any], None]


class Trainer(Hooks):
    """Subclass, implement ``compute_loss(batch) -> loss``, call ``fit(train_set, valid_set)``."""

    def __init__(
        self,
        run: Run,
        model: nn.Module,
        optimizer: OptimizerLike,
        scheduler: SchedulerLike = None,
        settings: Optional[TrainerSettings] = None,
        config: Any = None,
        **overrides: Any,
    ) -> None:
        """``config``: your recipe's own settings (any dataclass or mapping); ranks must agree on it."""
        base = (
            {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
            if settings
            else {}
        )
        self.settings = s = TrainerSettings.from_mapping({**base, **overrides})
        # check: its own folder
        self.settings = s = run.probe.trainer_settings(s).with_degrees(run.degrees)
        self.run = run
        self.config = config
        run.configure_parallelism(
            tp=s.tp, dp_replicate=s.dp_replicate, pp=s.pp, fault_tolerance=s.fault_tolerance
        )
        self.device = run.device
        self.precision = Precision(s.precision, self.device)
        if s.check_consistency:  # before DDP wraps the model: our diff, not DDP's shape error
            run.check_consistency(model, config, trainer_settings=s.plain())
        self.model, bound = run.setup(
            model,
            optimizer,
            strategy=s.strategy or run.strategy_name,
            activation_checkpointing=s.activation_checkpointing,
            **s.setup_options(),
        )
        if bound is None:
            raise ConfigError(
                "the Trainer needs an optimizer.",
                "pass one, or a factory like `lambda params: torch.optim.AdamW(params, lr=1e-3)`.",
            )
        if run.strategy is None:
            raise RuntimeError("run.setup left the run without a strategy")
        self.optimizer, self.strategy = bound, run.strategy
        #: What checkpoints read and write: the wrapped model, never torch.compile's wrapper of it.
        self.state_model = self.model
        # torch.compile's stubs say Callable: given a Module it returns an OptimizedModule (a Module)
        if s.compile:
            self.model = torch.compile(  # type: ignore[assignment]
                self.model, **(s.compile if isinstance(s.compile, dict) else {})
            )
        if (
            scheduler is not None
            and not callable(scheduler)
            and isinstance(optimizer, torch.optim.Optimizer)
            # ft-ddp wraps, keeps it
            and getattr(self.optimizer, "optim", self.optimizer) is not optimizer
        ):
            raise ConfigError(
                f"strategy {self.strategy.name!r} rebuilt the optimizer on its sharded parameters, so "
                "the scheduler given still drives the old one.",
                "pass a scheduler factory: scheduler=lambda optimizer: CosineAnnealingLR(optimizer, ...).",
            )
        # a factory or an instance
        self.scheduler = scheduler(self.optimizer) if callable(scheduler) else scheduler
        self._step = make_step(self)  # forward + backward, or (pp) the pipeline schedule's step
        self.state = TrainState()
        self.history: list[dict[str, Any]] = []
        self.layout, own = identity.settle(
            run,
            self.strategy.unwrap(self.state_model),
            self.optimizer,
            s.out_dir,
            s.fresh,
            s.resume_from,
        )
        self.replicas, self.out_dir = replicas.attach(self, own)
        self.checkpoint_dir = self.out_dir / "checkpoints"
        self.best_dir = self.checkpoint_dir / "best"
        identity.check_owned(self.out_dir)
        self.tracker = (
            BestTracker(s.monitor, s.mode, s.patience, s.min_delta) if s.monitor else None
        )
        # a queue search pruned this trial (run.report): stop as early stopping does
        self._pruned = False
        self.progress = ProgressLine(
            s.progress and run.is_main, every_s=s.progress_every_s, record=run.job.run_dir
        )
        self.loggers = Loggers([], self.out_dir, enabled=False)
        self._valid: Any = None
        self._epochs = s.epochs
        self._grad_norm: Optional[torch.Tensor] = None
        # profile, ema, guard
        self.extras = StepExtras(s, run, self.strategy.unwrap(self.state_model), self.out_dir)

    # ------------------------------------------------------------------ loops
    def fit(
        self, train: Any, valid: Any = None, epochs: Optional[int] = None
    ) -> list[dict[str, Any]]:
        s = self.settings
        self._epochs = epochs = s.epochs if epochs is None else epochs
        train_loader = self._loader(train, evaluation=False)
        self._valid = self._loader(valid, evaluation=True) if valid is not None else None
        if s.check_consistency:
            consistency.check_same_on_all_ranks(
                {
                    "train_samples": train_loader.samples,
                    "batch_size": train_loader.batch_size,
                    "valid_samples": self._valid.samples if self._valid is not None else None,
                    "epochs": epochs,
                },
                group=self.run.control_group,
            )
        if s.resume:
            self.resume()
        elif self.run.latest_checkpoint(self.checkpoint_dir, checksums=False) is not None:
            raise ConfigError(
                f"{self.checkpoint_dir} holds checkpoints of an earlier run and resume is off.",
                "set resume: true to continue that run, or choose a new out_dir.",
            )
        # replica groups: a group that comes back heals here
        train_loader.resume_at(*self.replicas.join(epochs))
        self.run.configure_guards(
            hang_timeout_s=s.hang_timeout_s,
            hang_notice_s=s.hang_notice_s,
            preemption=s.preemption,
            report_dir=str(self.out_dir / "hang"),
            stop_check_every=s.stop_check_every,
        )
        # With resume on, the files continue from this run's step - 0 when no checkpoint was found, so a
        # restart that crashed before its first checkpoint does not log steps 1..k twice.
        self.loggers = Loggers(
            s.loggers,
            self.out_dir,
            resume_step=self.state.global_step if s.resume else None,
            enabled=self.run.is_main,
        )
        self.loggers.log_hparams(hparams_of(s.plain(), consistency.plain(self.config)))
        reports.report_start(self, train_loader)
        clean = False
        try:
            self.on_fit_start()
            with self.extras.fitting(self.state.global_step):
                self._fit_epochs(train_loader, epochs)
            # the last asynchronous checkpoint, every rank
            self.run.wait_for_checkpoint(then=self.on_checkpoint)
            clean = True
        except Preempted:
            clean = True
            raise
        # the other ranks may be anywhere: never wait for them from here on
        except BaseException as exc:
            self.run.interrupted(type(exc).__name__)
            for loader in (train_loader, self._valid):
                if loader is not None:
                    loader.abandon()
            raise
        finally:
            self.run.release_guards(clean=clean)
            self.loggers.close()
        self.replicas.finished()
        self.on_fit_end()
        if s.plot and self.run.is_main:
            from multigpu.plots import write_curves

            write_curves(self.out_dir, quiet=True)
        return self.history

    def _fit_epochs(self, train_loader: Any, epochs: int) -> None:
        s = self.settings
        for epoch in range(self.state.epoch, epochs):
            if self._steps_done():
                break
            self.on_epoch_start(epoch + 1)
            started = time.monotonic()
            try:
                train_metrics, samples, completed = self._train_epoch(train_loader, epoch, epochs)
                stopping = False
            except validation.StopTraining:
                train_metrics, samples, completed, stopping = {}, 0, False, True
            elapsed = time.monotonic() - started
            if completed:
                if self.scheduler is not None and s.scheduler_interval == "epoch":
                    self.scheduler.step()
                self.state = TrainState(epoch + 1, 0, self.state.global_step)
            valid_metrics = (
                validation.validate(self) if completed and self._valid is not None else {}
            )
            length = train_loader.length
            done = 1 if completed else (self.state.batch_in_epoch / length if length else 0)
            row = {
                "epoch": round(epoch + done, 4),
                "step": self.state.global_step,
                **{f"train_{k}": v for k, v in train_metrics.items()},
                **{f"valid_{k}": v for k, v in valid_metrics.items()},
                "lr": self.optimizer.param_groups[0]["lr"],
                "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
                "epoch_s": elapsed,
            }
            if train_metrics or valid_metrics:
                self._record(row)
                self.progress.epoch_done(
                    epoch + 1, epochs, {k: v for k, v in row.items() if k not in ("epoch", "step")}
                )
            stopping = (
                stopping or (self.tracker is not None and self.tracker.should_stop) or self._pruned
            )
            if not completed or stopping:
                # resumable from here (a larger max_steps, or the best checkpoint is kept)
                checkpoints.save(self)
                if stopping and self.tracker is not None and not self._pruned:
                    self.run.print(
                        f"multigpu: early stop: {s.monitor} did not improve by more than "
                        f"{s.min_delta:g} for {s.patience} validation(s); best {self.tracker.best:.6g} "
                        f"at step {self.tracker.best_step}"
                    )
                break
            with self.run.paused_watchdog():
                self.on_epoch_end(epoch + 1, row)
            if (epoch + 1) % s.checkpoint_every_epochs == 0 or epoch + 1 == epochs:
                checkpoints.save(self)

    def _train_epoch(
        self, loader: LoaderLike, epoch: int, epochs: int
    ) -> tuple[dict[str, float], int, bool]:
        """One epoch (or what is left of it); returns (metrics, samples, completed)."""
        s, run = self.settings, self.run
        self.model.train()
        total = loader.length  # the whole epoch; None for a stream
        # Batches need moving unless everything is on the CPU (a CPU run on a GPU machine may still
        # load CUDA tensors).
        on_accelerator = self.device.type != "cpu" or torch.cuda.is_available()
        tally = reports.Tally(self.device)
        completed = True
        if loader.num_workers:
            run.settle()  # no all-reduce in flight while the workers are forked
        for index, batch in enumerate(loader, start=self.state.batch_in_epoch):
            if on_accelerator:
                batch = move_to(batch, self.device)
            boundary = (
                (index + 1) % s.accumulate == 0
                or (total is not None and index + 1 == total)
                or (total is None and s.accumulate > 1 and loader.ends_after_current())
            )
            with contextlib.nullcontext() if boundary else self.strategy.no_sync(self.model):
                # pp: the schedule's step
                detached = self._step.train(batch, loader.batch_size).detach()
            tally.add(detached, batch_length(batch))
            run.probe.record_loss(detached, s.accumulate)  # `multigpu check` (a no-op otherwise)
            committed = boundary and self._optimizer_step(tally, index)
            self.state.batch_in_epoch = index + 1
            run.step_done(self.state.global_step)
            self.on_train_batch_end(self.state.global_step, detached)
            if self.progress.wants_update():
                show_progress(self, epoch, epochs, index + 1, total, tally.mean(), *tally.counts())
            if committed and self._after_step(tally, epoch, index + 1, total):
                completed = total is not None and index + 1 == total
                break
        metrics = run.metric_sums()
        metrics.add("loss", tally.loss_sum, tally.batches)
        return metrics.compute(), tally.samples * run.dp_size, completed

    def _optimizer_step(self, tally: reports.Tally, index: int) -> bool:
        """Unscale, clip, let the step guard judge, step (or skip), zero, schedule; True when the step
        counts (False: replica groups dropped it; a guard's skip counts)."""
        s, guard, optimizer = self.settings, self.extras.guard, self.optimizer
        self.precision.unscale(optimizer)
        if s.clip_grad_norm is not None or guard is not None:  # the guard reads the global norm
            self._grad_norm = self.strategy.clip_grad_norm(
                self.model, s.clip_grad_norm or float("inf")
            )
        dropped = (
            guard.check(tally.loss_sum, index % s.accumulate + 1, self._grad_norm, self.state)
            if guard is not None and self._grad_norm is not None
            else 0
        )
        stepped = self.precision.step(optimizer) if not dropped else self.precision.skip()
        committed = stepped or bool(dropped)
        optimizer.zero_grad(set_to_none=True)
        if stepped and self.scheduler is not None and s.scheduler_interval == "step":
            self.scheduler.step()
        self.state.global_step += int(committed)
        self.replicas.after_step(committed)
        if self.extras.after_each_step:  # averaging, profiling
            self.extras.after_step(stepped, self.state.global_step)
        tally.drop(dropped)  # a skipped step's batches
        return committed

    def _after_step(
        self, tally: reports.Tally, epoch: int, done: int, total: Optional[int]
    ) -> bool:
        """What a committed step may bring: a step row, a checkpoint, a validation, the agreed stop of a
        preemption; True when max_steps is reached."""
        s, step = self.settings, self.state.global_step
        if s.log_every_n_steps and step % s.log_every_n_steps == 0:
            reports.log_step(self, *tally.take_window(), epoch, done, total)
        if s.checkpoint_every_steps and step % s.checkpoint_every_steps == 0:
            checkpoints.save(self)
        last_of_epoch = total is not None and done == total  # the epoch's own validation follows
        if s.eval_every_steps and step % s.eval_every_steps == 0 and self._valid is not None:
            if not last_of_epoch:
                validation.validate_inside_epoch(self, epoch, done, total)
        if self.run.should_stop():
            self._preempt()
        return self._steps_done()

    def _steps_done(self) -> bool:
        return (
            self.settings.max_steps is not None
            and self.state.global_step >= self.settings.max_steps
        )

    def _preempt(self) -> None:
        """Every rank agreed to stop at this step: checkpoint it, requeue under Slurm on USR1, exit 75."""
        path = checkpoints.save(self, blocking=True)
        self.run.exit_preempted(path, self.state.global_step)

    @torch.no_grad()
    def evaluate(self, data: Any) -> dict[str, float]:
        """Global metrics over ``data`` (a dataset, a DataLoader, a stream or an eval loader); exact across
        any number of ranks.

        Replicated models are evaluated without their DDP wrapper (whose forward may broadcast buffers -
        a collective the ranks would not all join). Sharded models need every rank's forward, so ranks
        with fewer batches repeat one whose results are dropped.
        """
        loader = self._loader(data, evaluation=True)
        wrapped = self.model
        sharded_model = self.strategy.sharded or self.run.degrees.tp > 1
        self.model = wrapped if sharded_model else self.strategy.unwrap(wrapped)
        self.model.eval()
        try:
            # evaluation.evaluate_shard (pp: through the pipeline)
            return self._step.evaluate(loader, sharded_model)
        finally:
            self.model = wrapped
            self.model.train()

    def _loader(self, data: Any, evaluation: bool) -> LoaderLike:
        s = self.settings
        loader: LoaderLike = (
            self.run.eval_loader(
                data,
                s.eval_batch_size or s.batch_size,
                collate_fn=s.collate_fn,
                num_workers=s.num_workers,
            )
            if evaluation
            else self.run.loader(
                data,
                s.batch_size,
                shuffle=s.shuffle,
                seed=s.seed,
                drop_last=s.drop_last,
                num_workers=s.num_workers,
                collate_fn=s.collate_fn,
                quiet=True,
            )
        )
        return loader

    def _record(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        self.loggers.log_metrics(row, row["step"], kind="epoch")

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the model and optimizer (as objects: the run saves them
        in the strategy's format), scheduler, scaler, counters, data layout, settings and the best-metric
        tracker. Extend it to save more (for state that differs per rank, use ``rank_state``)."""
        return checkpoints.state_of(self)

    def save(self) -> Path:
        """Write a checkpoint of the current state (every rank calls it; returns once it exists)."""
        return checkpoints.save(self, blocking=True)

    def resume(self) -> bool:
        """Load the newest checkpoint that verifies, if any; corrupt ones are reported and skipped.
        Settings given now win over the checkpoint's for hyperparameters (learning rate, weight decay,
        ...); every difference is printed once. A changed model still fails, clearly."""
        return checkpoints.resume_latest(self)

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restore the rest of ``checkpoint_state()`` (the run already restored model and optimizer).
        A checkpoint is data from disk: counters of the wrong type or sign, or states that do not fit,
        are a CheckpointError naming what is wrong, never a traceback or an endless loop."""
        checkpoints.restore(self, state)


__all__ = ["Trainer"]
