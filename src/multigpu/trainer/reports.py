"""What a Trainer reports as it trains: the start report before the first step, and each step's row.

Why apart from the loop: both gather from every part of the run (strategy, precision, loader, extras,
the gradient norm, GPU memory) and only rank 0 writes them; the loop only says when.
"""

from __future__ import annotations

import time
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


class Tally:
    """An epoch's loss sum and counts, and the window since the last step row (one accumulation per
    batch: the row's mean is the difference of two sums, never a second running sum)."""

    def __init__(self, device: torch.device) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.window_start = self.loss_sum.clone()
        self.batches = self.samples = self.window_batches = self.window_samples = 0
        self.started = self.window_started = time.monotonic()

    def add(self, loss: torch.Tensor, samples: int) -> None:
        self.loss_sum += loss
        self.batches += 1
        self.window_batches += 1
        self.samples += samples
        self.window_samples += samples

    def drop(self, batches: int) -> None:
        """The batches of a step the guard skipped: out of the means."""
        self.batches -= batches
        self.window_batches -= batches

    def mean(self) -> torch.Tensor:
        return self.loss_sum / self.batches

    def counts(self) -> tuple[int, int, float]:
        """(samples, batches, started): what the progress line reads."""
        return self.samples, self.batches, self.started

    def take_window(self) -> tuple[torch.Tensor, int, float]:
        """The window's (mean loss, samples, seconds), and a new window from now."""
        now = time.monotonic()
        window = (
            (self.loss_sum - self.window_start) / max(self.window_batches, 1),
            self.window_samples,
            now - self.window_started,
        )
        self.window_start = self.loss_sum.clone()
        self.window_batches = self.window_samples = 0
        self.window_started = now
        return window
