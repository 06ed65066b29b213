"""Validation inside the fit: the metrics, the best checkpoint, early stopping and a search's pruning.

Why apart from the loop: after each validation pass three features decide whether training goes on -
the best-metric tracker (which saves checkpoints/best), early stopping, and a queue search's pruner
(``run.report``: every rank hears the same verdict) - and they decide it the same on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from multigpu.errors import ConfigError
from multigpu.trainer import checkpoints
from multigpu.trainer.progress import format_metrics

if TYPE_CHECKING:
    from multigpu.trainer.loop import Trainer


class StopTraining(Exception):
    """Early stopping (or a search's pruning) decided inside an epoch (the same on every rank)."""


def validate(trainer: Trainer) -> dict[str, float]:
    """One validation pass: its metrics, the best checkpoint when they improve, a trial's report."""
    # the evaluation loader may fork workers: no all-reduce in flight meanwhile
    trainer.run.settle()
    trainer.on_evaluate_start()
    # the averaged weights, when averaging is on
    with trainer.run.paused_watchdog(), trainer.extras.averaged():
        metrics = trainer.evaluate(trainer._valid)
    trainer.on_validation_end(metrics)
    value = {**{f"valid_{k}": v for k, v in metrics.items()}, **metrics}
    if trainer.tracker is not None:
        key = trainer.settings.monitor
        if trainer.tracker.value(value) is None:
            raise ConfigError(
                f"monitor {key!r} is not among the validation metrics "
                f"({', '.join(f'valid_{k}' for k in metrics)}).",
                "set monitor to one of them.",
            )
        if trainer.tracker.update(value, trainer.state.global_step):
            checkpoints.save_best(trainer, trainer.tracker)
    # a queue trial: every rank hears the same
    trainer._pruned |= trainer.run.report(value, trainer.state.global_step)
    return metrics


def validate_inside_epoch(trainer: Trainer, epoch: int, done: int, total: Optional[int]) -> None:
    """A validation every ``eval_every_steps``: its row, and :class:`StopTraining` when it says stop."""
    metrics = validate(trainer)
    row = {
        "epoch": round(epoch + (done / total if total else 0), 4),
        "step": trainer.state.global_step,
        **{f"valid_{k}": v for k, v in metrics.items()},
    }
    trainer._record(row)
    trainer.progress.line(
        f"step {trainer.state.global_step}: {format_metrics({k: v for k, v in row.items() if k != 'step'})}"
    )
    if (trainer.tracker is not None and trainer.tracker.should_stop) or trainer._pruned:
        raise StopTraining()
    trainer.model.train()
