"""The Trainer's settings and counters: what a recipe's YAML sets, and what a checkpoint restores.

Why a module of its own: the settings are read by config files, the consistency check, loggers and
checkpoints without any of the loop's machinery, and the loop reads better without 90 lines of fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from multigpu.config import check_keys
from multigpu.errors import ConfigError


@dataclass
class TrainerSettings:
    """Everything the loop does besides your ``compute_loss``; each field can come from a YAML file."""

    epochs: int = 1
    #: Stop after this many optimizer steps, even inside an epoch (None: run every epoch).
    max_steps: Optional[int] = None
    batch_size: int = 32  # per data-parallel rank: the global batch is batch_size x ranks x accumulate
    eval_batch_size: Optional[int] = None
    accumulate: int = 1
    clip_grad_norm: Optional[float] = None
    precision: str = "32"
    strategy: Optional[str] = None  # None: the one given to mg.init() ("auto" unless said otherwise)
    strategy_options: dict = field(default_factory=dict)
    #: Tensor-parallel ranks per model replica (strategy fsdp+tp) and replica groups (hsdp).
    tp: int = 1
    dp_replicate: int = 1
    #: torch.compile the model after wrapping: true, or a mapping of torch.compile's options.
    compile: Any = False
    scheduler_interval: str = "step"  # or "epoch"
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    num_workers: int = 0
    #: Batches from datasets are collated with this (not from YAML; your DataLoader keeps its own).
    collate_fn: Optional[Callable] = None
    out_dir: str = "outputs"
    checkpoint_every_epochs: int = 1
    checkpoint_every_steps: Optional[int] = None
    keep_last: int = 2
    #: Write checkpoints in the background: training waits only while the state is copied to CPU memory
    #: (one more copy of it held there). At most one in flight; preemption checkpoints are synchronous.
    #: null: in the background when training on an accelerator (on CPU the writer competes with training
    #: for the same cores: benchmarks/checkpoint_save.py measured no gain there).
    async_checkpoint: Optional[bool] = None
    resume: bool = True
    verify_checksums: bool = True
    #: Where the numbers go besides metrics.csv/steps.csv: tensorboard, wandb, mlflow.
    loggers: list = field(default_factory=list)
    #: A row of step metrics (loss, lr, samples/s, grad norm, GPU memory) every N optimizer steps (0: none).
    log_every_n_steps: int = 50
    progress: bool = True
    #: In a log file (not a terminal), a progress line every so many seconds.
    progress_every_s: float = 30.0
    #: Validate every N optimizer steps too, not only after each epoch (exact across ranks).
    eval_every_steps: Optional[int] = None
    #: Keep the best checkpoint by this metric (e.g. valid_loss) in checkpoints/best; stop early after
    #: ``patience`` validations without an improvement larger than ``min_delta``.
    monitor: Optional[str] = None
    mode: str = "min"
    patience: Optional[int] = None
    min_delta: float = 0.0
    #: Write curves.png into out_dir at the end of fit (when matplotlib is installed).
    plot: bool = True
    #: Stop cleanly on SIGTERM/SIGUSR1: finish the step, checkpoint, exit 75 (requeue under Slurm on USR1).
    preemption: bool = True
    #: Agree on stopping every K optimizer steps (None: about every 2 s, from the step time).
    stop_check_every: Optional[int] = None
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
            (self.eval_every_steps is None or self.eval_every_steps >= 1, "eval_every_steps", "1 or more, or null"),
            (self.log_every_n_steps >= 0, "log_every_n_steps", "0 (off) or more"),
            (self.progress_every_s > 0, "progress_every_s", "positive seconds"),
            (self.stop_check_every is None or self.stop_check_every >= 1, "stop_check_every", "1 or more, or null"),
            (self.collate_fn is None or callable(self.collate_fn), "collate_fn", "a function (set it in code)"),
            (isinstance(self.compile, (bool, dict)), "compile", "true, false, or a mapping of torch.compile options"),
            (self.mode in ("min", "max"), "mode", "'min' or 'max'"),
            (self.patience is None or self.monitor is not None, "patience", "null unless monitor is set"),
            (self.eval_batch_size is None or self.eval_batch_size >= 1, "eval_batch_size", "1 or more, or null"),
            (self.async_checkpoint in (None, True, False), "async_checkpoint", "true, false, or null (on for GPUs)"),
        ]
        for ok, name, wanted in checks:
            if not ok:
                raise ConfigError(f"trainer setting {name}={getattr(self, name)!r} is invalid.", f"use {wanted}.")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "TrainerSettings":
        check_keys(cls, values, owner="the Trainer", noun="setting")
        return cls(**dict(values))

    def background_checkpoints(self, device: Any) -> bool:
        """``async_checkpoint``; null means on when the model trains on an accelerator, off on the CPU."""
        return self.async_checkpoint if self.async_checkpoint is not None else getattr(device, "type", "cpu") != "cpu"

    def plain(self) -> dict[str, Any]:
        """The settings as data (for hashing, logging, checkpoints): no functions."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "collate_fn"}


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed (the one in progress is epoch + 1)
    batch_in_epoch: int = 0  # batches of that epoch already trained on
    global_step: int = 0  # optimizer steps taken
