"""What a Trainer reports as it trains: the start report before the first step, and each step's row.

Why apart from the loop: both gather from every part of the run (strategy, precision, loader, extras,
the gradient norm, GPU memory) and only rank 0 writes them; the loop only says when.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from multigpu.data import LoaderLike
from multigpu.trainer.progress import start_report

if TYPE_CHECKING:
    from multigpu.trainer.loop import Trainer


def report_start(trainer: Trainer, loader: LoaderLike) -> None:
    """What runs, on rank 0, before the first step: nobody trains a week with the wrong setup."""
    if trainer.run.is_main:
        for line in (
            start_report(
                trainer.run,
                trainer.settings,
                trainer.state_model,
                loader,
                trainer.strategy.name,
                trainer.precision.mode,
            )
            + trainer.extras.report()
        ):
            trainer.run.print(line)


def log_step(
    trainer: Trainer,
    mean_loss: torch.Tensor,
    samples: int,
    elapsed: float,
    epoch: int,
    done: int,
    total: Optional[int],
) -> None:
    """A step row - rank 0's own loss (reading it is the only sync, on logging steps only)."""
    if not trainer.run.is_main:
        return
    row: dict[str, Any] = {
        "epoch": round(epoch + (done / total if total else 0), 4),
        "loss": mean_loss.item(),
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "samples_per_s": samples * trainer.run.dp_size / elapsed if elapsed > 0 else 0.0,
    }
    if trainer._grad_norm is not None:
        row["grad_norm"] = float(trainer._grad_norm)
    row.update(trainer.extras.row())
    if trainer.device.type == "cuda":
        row["gpu_mem_peak_mb"] = torch.cuda.max_memory_allocated(trainer.device) / 2**20
    trainer.loggers.log_metrics(row, trainer.state.global_step, kind="step")
