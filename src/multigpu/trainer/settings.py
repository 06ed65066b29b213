"""The Trainer's settings and counters: what a recipe's YAML sets, and what a checkpoint restores.

Why a module of its own: the settings are read by config files, the consistency check, loggers and
checkpoints without any of the loop's machinery, and the loop reads better without 90 lines of fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from multigpu.config import check_keys
from multigpu.errors import ConfigError, shown
from multigpu.trainer.options import compile_settings, profile_settings
from multigpu.validate import (
    Rule,
    activation_checkpointing_settings,
    checked,
    rules_of,
    setting,
)

#: Every spelling of a precision (Lightning's and torch's too) -> the one it means; read by ``precision``.
PRECISIONS = {
    "32": "32",
    "fp32": "32",
    "32-true": "32",
    "float32": "32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "bfloat16": "bf16",
    "16": "fp16",
    "fp16": "fp16",
    "16-mixed": "fp16",
    "float16": "fp16",
}

#: The loggers a settings file may name (multigpu.loggers.BACKENDS, spelled here to keep torch out).
LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")
_BIG = 10**15
#: torch.distributed.pipelining's schedules a run may choose (multigpu.strategies.schedules.SCHEDULES).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass
class TrainerSettings:
    """Everything the loop does besides your ``compute_loss``; each field can come from a YAML file."""

    epochs: int = setting(1, low=0, high=10**9)
    #: Stop after this many optimizer steps, even inside an epoch (None: run every epoch).
    max_steps: Optional[int] = setting(None, low=0, high=_BIG)
    #: Per data-parallel rank: the global batch is batch_size x ranks x accumulate.
    batch_size: int = setting(32, low=1, high=2**31)
    eval_batch_size: Optional[int] = setting(None, low=1, high=2**31)
    accumulate: int = setting(1, low=1, high=10**6)
    clip_grad_norm: Optional[float] = setting(None, low=0, high=1e12, positive=True)
    precision: str = setting("32", choices=tuple(PRECISIONS))
    # None: the one given to mg.init() ("auto" unless said otherwise)
    strategy: Optional[str] = None
    strategy_options: dict[str, Any] = field(default_factory=dict)
    #: Tensor-parallel ranks per model replica (strategy fsdp+tp) and replica groups (hsdp). Left at 1 with
    #: pp, the Trainer takes the degrees given to mg.init() (``with_degrees``).
    tp: int = setting(1, low=1, high=4096)
    dp_replicate: int = setting(1, low=1, high=65536)
    #: Pipeline stages on consecutive groups of ranks (each stage wrapped by the strategy: ddp, fsdp,
    #: hsdp, fsdp+tp); its schedule, micro-batches per batch (None: one per stage) and where stages begin
    #: (names or indexes of the model's children; None: balanced by parameters). docs/strategies.md.
    pp: int = setting(1, low=1, high=4096)
    pipeline_schedule: str = setting("1f1b", choices=PIPELINE_SCHEDULES)
    micro_batches: Optional[int] = setting(None, low=1, high=4096)
    split_points: Optional[list[Any]] = None
    #: torch.compile the model after wrapping: true, or a mapping of torch.compile's options.
    compile: Any = False
    scheduler_interval: str = setting("step", choices=("step", "epoch"))
    seed: int = setting(0, low=0, high=2**63 - 1)
    shuffle: bool = True
    drop_last: bool = False
    num_workers: int = setting(0, low=0, high=256)
    #: Batches from datasets are collated with this (not from YAML; your DataLoader keeps its own).
    collate_fn: Optional[Callable[..., Any]] = None
    out_dir: str = "outputs"
    checkpoint_every_epochs: int = setting(1, low=1, high=10**9)
    checkpoint_every_steps: Optional[int] = setting(None, low=1, high=_BIG)
    keep_last: int = setting(2, low=1, high=10**6)
    #: Write checkpoints in the background: training waits only while the state is copied to CPU memory
    #: (one more copy of it held there). At most one in flight; preemption checkpoints are synchronous.
    #: null: in the background when training on an accelerator (on CPU the writer competes with training
    #: for the same cores: benchmarks/checkpoint_save.py measured no gain there).
    async_checkpoint: Optional[bool] = None
    #: Continue the run of this model found in out_dir (or in out_dir-2, -3, ...: a run of another model
    #: gets the next free one; trainer/identity.py). ``fresh``: always a new run, in a folder without
    #: checkpoints. ``resume_from``: start from that checkpoint (a run folder, its checkpoints folder or a
    #: step-N folder) unless this run's folder already holds checkpoints of its own (a restart continues).
    resume: bool = True
    fresh: bool = False
    resume_from: Optional[str] = setting(None, blank=False)
    verify_checksums: bool = True
    #: Where the numbers go besides metrics.csv/steps.csv: tensorboard, wandb, mlflow.
    loggers: list[Any] = field(default_factory=list)
    #: A row of step metrics (loss, lr, samples/s, grad norm, GPU memory) every N optimizer steps (0: none).
    log_every_n_steps: int = setting(50, low=0, high=_BIG)
    progress: bool = True
    #: In a log file (not a terminal), a progress line every so many seconds.
    progress_every_s: float = setting(30.0, low=0, high=1e7, positive=True)
    #: The progress line's throughput: ``items_per_sample`` x samples/s, named ``throughput_unit``
    #: (a language model's block of 1,024 tokens: 1024 and "tokens").
    throughput_unit: str = "samples"
    items_per_sample: float = setting(1.0, low=0, high=1e12, positive=True)
    #: Validate every N optimizer steps too, not only after each epoch (exact across ranks).
    eval_every_steps: Optional[int] = setting(None, low=1, high=_BIG)
    #: Keep the best checkpoint by this metric (e.g. valid_loss) in checkpoints/best; stop early after
    #: ``patience`` validations without an improvement larger than ``min_delta``.
    monitor: Optional[str] = None
    mode: str = setting("min", choices=("min", "max"))
    patience: Optional[int] = setting(None, low=0, high=10**9)
    min_delta: float = setting(0.0, low=0, high=1e30)
    #: Write curves.png into out_dir at the end of fit (when matplotlib is installed).
    plot: bool = True
    #: Stop cleanly on SIGTERM/SIGUSR1: finish the step, checkpoint, exit 75 (requeue under Slurm on USR1).
    preemption: bool = True
    #: Agree on stopping every K optimizer steps (None: about every 2 s, from the step time).
    stop_check_every: Optional[int] = setting(None, low=1, high=10**9)
    #: Write where every rank is stuck and exit when no step finishes for this long (None: off).
    hang_timeout_s: Optional[float] = setting(900.0, low=0, high=1e9, positive=True)
    #: Before that, one line naming where every rank is after this long without a step (None: none).
    hang_notice_s: Optional[float] = setting(60.0, low=0, high=1e9, positive=True)
    #: Compare model, settings, data and versions across ranks before training; fail with a diff.
    check_consistency: bool = True
    #: Recompute each block's activations in backward instead of keeping them: true (every repeated block),
    #: {every: 2} (every 2nd), {blocks: [Block]} (by class name). Applied by the strategy (docs/api.md).
    activation_checkpointing: Any = False
    #: torch.profiler over optimizer steps: true ({wait: 1, warmup: 1, active: 3}) or a mapping; traces per rank
    #: in out_dir/profile, the top operators of rank 0 printed (docs/observability.md).
    profile: Any = False
    #: On CUDA, record allocations and write a memory snapshot per rank when a step runs out of memory.
    memory_snapshot_on_oom: bool = False
    #: Keep an exponential moving average of the weights with this decay (e.g. 0.999), or an equal-weight
    #: average of the weights after every optimizer step from step ``swa_start`` on; validation uses it.
    ema: Optional[float] = setting(None, low=0, high=1, positive=True)
    swa_start: Optional[int] = setting(None, low=1, high=_BIG)
    #: Skip an optimizer step (on every rank) whose loss or gradient norm is NaN/inf, whose gradient norm is
    #: above ``skip_grad_norm_above`` or whose loss is above ``skip_loss_above``; stop after so many in a row.
    skip_nonfinite: bool = False
    skip_grad_norm_above: Optional[float] = setting(None, low=0, high=1e12, positive=True)
    skip_loss_above: Optional[float] = setting(None, low=-1e12, high=1e12)
    max_skipped_in_a_row: int = setting(20, low=1, high=10**9)
    #: Replica groups that keep training when one dies (torchft): ``{replica_groups: R, min_replicas: M}``.
    #: The launch decides (``multigpu run --replica-groups R --min-replicas M``); set here, it must match
    #: it, so a recipe meant for replica groups is not run without them by mistake.
    fault_tolerance: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        """The settings door: every setting typed and bounded, on every path (YAML, KEY=VALUE overrides, a
        runs file, the Python API), before anything runs - one line naming the setting, never a traceback."""
        if isinstance(self.precision, int) and not isinstance(self.precision, bool):
            self.precision = str(self.precision)  # precision=16 in code, as Lightning spells it
        for name, rule in SETTING_RULES.items():
            checked("trainer", name, getattr(self, name), rule, ConfigError)
        self.compile = compile_settings(self.compile, ConfigError)
        self.activation_checkpointing = activation_checkpointing_settings(
            self.activation_checkpointing, ConfigError
        )
        self.profile = profile_settings(self.profile, ConfigError)
        if not isinstance(self.strategy_options, dict) or len(self.strategy_options) > 64:
            raise ConfigError(
                f"trainer setting strategy_options={shown(self.strategy_options)} is invalid.",
                "use a mapping of the strategy's options (see docs/strategies.md).",
            )
        for logger in self.loggers:
            checked("trainer", "loggers", logger, Rule(str, choices=LOGGERS), ConfigError)
        self.fault_tolerance = fault_tolerance_settings(self.fault_tolerance)
        for point in self.split_points or []:  # a child's name, or its index
            checked(
                "trainer",
                "split_points",
                point,
                Rule(str) if isinstance(point, str) else Rule(int, 0, 4096),
                ConfigError,
            )
        pipelined = self.pp > 1 or (
            self.pipeline_schedule == "1f1b"
            and self.micro_batches is None
            and self.split_points is None
        )
        relations = [
            (
                self.collate_fn is None or callable(self.collate_fn),
                "collate_fn",
                "a function (set it in code)",
            ),
            (
                self.patience is None or self.monitor is not None,
                "patience",
                "null unless monitor is set",
            ),
            (self.ema is None or self.ema < 1, "ema", "a decay below 1, e.g. 0.999"),
            (
                self.ema is None or self.swa_start is None,
                "swa_start",
                "null when ema is set (one average at a time)",
            ),
            (
                pipelined,
                "pp",
                "2 or more with pipeline_schedule, micro_batches or split_points (the in-process "
                "pipeline strategy takes its own in strategy_options)",
            ),
            (
                self.pp == 1 or not self.compile,
                "compile",
                "false with pp (the pipeline runs each stage itself)",
            ),
            (
                self.pp == 1 or PRECISIONS[str(self.precision).lower()] != "fp16",
                "precision",
                "32 or bf16 with pp (fp16's loss scaler would skip steps on some stages and not others)",
            ),
            (
                self.pp == 1 or self.batch_size % self._micro_batches() == 0,
                "micro_batches",
                f"a divisor of batch_size {self.batch_size} (micro-batches are equal; the default is one per stage)",
            ),
            (
                self.pp == 1
                or not {"schedule", "micro_batches", "split_points"} & set(self.strategy_options),
                "strategy_options",
                "the strategy's own options; with pp set pipeline_schedule, micro_batches and "
                "split_points as trainer settings",
            ),
        ]
        for ok, name, wanted in relations:
            if not ok:
                raise ConfigError(
                    f"trainer setting {name}={shown(getattr(self, name))} is invalid.",
                    f"use {wanted}.",
                )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "TrainerSettings":
        check_keys(cls, values, owner="the Trainer", noun="setting")
        return cls(**dict(values))

    def background_checkpoints(self, device: Any) -> bool:
        """``async_checkpoint``; null means on when the model trains on an accelerator, off on the CPU."""
        return (
            self.async_checkpoint
            if self.async_checkpoint is not None
            else getattr(device, "type", "cpu") != "cpu"
        )

    def _micro_batches(self) -> int:
        """Micro-batches per batch with pp: as set, or one per stage (strategies.pipeline_parallel's default)."""
        stages = (
            len(self.split_points) + 1
            if self.split_points
            else self.pp * (2 if self.pipeline_schedule == "interleaved_1f1b" else 1)
        )
        return self.micro_batches or stages

    def setup_options(self) -> dict[str, Any]:
        """The strategy's options for ``run.setup``; with pp > 1 the pipeline's too."""
        if self.pp == 1:
            return dict(self.strategy_options)
        return {
            **self.strategy_options,
            "schedule": self.pipeline_schedule,
            "micro_batches": self.micro_batches,
            "split_points": self.split_points,
        }

    def with_degrees(self, degrees: Any) -> "TrainerSettings":
        """Settings that leave tp, dp_replicate and pp at 1 take the Run's degrees (mg.init()'s): a script
        that gave ``mg.init(tp=2)`` keeps tp 2 under a Trainer whose settings say nothing of it (they set it
        back to 1). Settings that name a degree are the Trainer's, as before."""
        names = ("tp", "dp_replicate", "pp")
        if any(getattr(self, name) != 1 for name in names):
            return self
        given = {name: getattr(degrees, name) for name in names if getattr(degrees, name) != 1}
        return dataclasses.replace(self, **given) if given else self

    def plain(self) -> dict[str, Any]:
        """The settings as data (for hashing, logging, checkpoints): no functions."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "collate_fn"
        }


#: Each setting's type and bounds, from its declaration above: the door every value passes (docs/security.md).
SETTING_RULES = rules_of(TrainerSettings)


#: ``fault_tolerance``'s keys, typed and bounded like every other setting.
FAULT_TOLERANCE_RULES = {"replica_groups": Rule(int, 1, 1024), "min_replicas": Rule(int, 1, 1024)}


def fault_tolerance_settings(value: Any) -> Optional[dict[str, Any]]:
    """``fault_tolerance``: null, or a mapping of replica_groups (required) and min_replicas (default 1,
    at most replica_groups)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or "replica_groups" not in value:
        raise ConfigError(
            f"trainer setting fault_tolerance={shown(value)} is invalid.",
            "use null, or e.g. {replica_groups: 2, min_replicas: 1}.",
        )
    for key in value:
        if key not in FAULT_TOLERANCE_RULES:
            raise ConfigError(
                f"fault_tolerance has no setting {shown(key)}.",
                f"choose from {', '.join(FAULT_TOLERANCE_RULES)}.",
            )
    plain = {"min_replicas": 1, **dict(value)}
    for key, rule in FAULT_TOLERANCE_RULES.items():
        checked("fault_tolerance", key, plain[key], rule, ConfigError)
    if plain["min_replicas"] > plain["replica_groups"]:
        raise ConfigError(
            f"fault_tolerance: min_replicas {plain['min_replicas']} is more than replica_groups "
            f"{plain['replica_groups']}.",
            "use a min_replicas from 1 to replica_groups.",
        )
    return plain


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed (the one in progress is epoch + 1)
    batch_in_epoch: int = 0  # batches of that epoch already trained on
    global_step: int = 0  # optimizer steps taken
