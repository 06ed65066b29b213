"""The rank-0 progress line: samples/s and an ETA, redrawn in place on a terminal, printed as a line
every ``every_s`` seconds in a log file.

Why not a progress-bar library in the training step: a bar redrawn every step costs more than the
step of a small model; this one checks the clock only when asked (``wants_update``), redraws at most
every ``interval_s`` on a terminal, and in a log file (Slurm, CI, ``multigpu queue``) prints one line
every ``every_s`` (default 30 s) so a log shows life before the first epoch ends.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Mapping, Optional, TextIO

from multigpu.errors import visible


def format_metrics(values: Mapping[str, Any]) -> str:
    parts = []
    for key, value in values.items():
        if isinstance(value, float):
            parts.append(f"{key} {value:,.0f}" if abs(value) >= 1000 else f"{key} {value:.4g}")
        else:
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


#: The progress a queue's run leaves in its folder for the queue's table (``multigpu.queue.display``).
PROGRESS_FILE = "progress.json"


class ProgressLine:
    """``record``: the folder of a queue's run (``World.run_dir``) - every ``record_s`` the same numbers go
    into its ``progress.json`` as well, so the queue's table shows each run's step and ETA."""

    def __init__(
        self,
        enabled: bool,
        stream: Optional[TextIO] = None,
        interval_s: float = 0.25,
        every_s: float = 30.0,
        record: Optional[str] = None,
        record_s: float = 2.0,
    ) -> None:
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.interval_s = interval_s if self.live else every_s
        self.record, self.record_s = (record if enabled else None), record_s
        self._last = self._recorded = self.began = time.monotonic()
        self._width = 0

    def wants_update(self) -> bool:
        """Cheap enough for every step: one clock read on rank 0, nothing elsewhere."""
        if not self.enabled:
            return False
        now = time.monotonic()
        return now - self._last >= self.interval_s or (
            self.record is not None and now - self._recorded >= self.record_s
        )

    def update(
        self,
        epoch: int,
        epochs: int,
        done: int,
        total: Optional[int],
        loss: float,
        samples_per_s: float,
        eta_s: Optional[float] = None,
        unit: str = "samples",
        steps: Optional[tuple[int, int]] = None,
    ) -> None:
        """``epoch`` counts from 1, as everywhere the user sees it. ``samples_per_s`` is in ``unit`` (the
        Trainer's ``throughput_unit``). ``steps`` (done, of): the bar counts optimizer steps instead of the
        epoch's batches - when ``max_steps`` ends the run before the epoch ends, so bar and ETA agree."""
        if not self.enabled:
            return
        now = time.monotonic()
        # JSON and the line: no NaN
        eta_s = eta_s if eta_s is not None and math.isfinite(eta_s) else None
        bar_done, bar_total = steps if steps is not None else (done, total)
        if self.record is not None and now - self._recorded >= self.record_s:
            self._recorded = now
            self._write_record(
                {
                    "epoch": epoch,
                    "epochs": epochs,
                    "done": bar_done,
                    "of": bar_total,
                    "counts": "steps" if steps else "batches",
                    "eta_s": eta_s,
                    "elapsed_s": round(now - self.began, 1),
                }
            )
        if now - self._last < self.interval_s:
            return
        self._last = now
        if bar_total:
            filled = min(20, int(20 * bar_done / max(bar_total, 1)))
            where = f"[{'=' * filled}{' ' * (20 - filled)}] {'step ' if steps else ''}{bar_done}/{bar_total}"
        else:
            where = f"batch {done}"
        eta = f" ETA {format_duration(eta_s)}" if eta_s is not None else ""
        text = (
            f"epoch {epoch}/{epochs} {where} loss {loss:.4g} {samples_per_s:,.0f} {visible(unit[:40])}/s "
            f"elapsed {format_duration(self._last - self.began)}{eta}"
        )
        if self.live:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _write_record(self, values: Mapping[str, Any]) -> None:
        import json

        from multigpu.fileio import Folder

        try:
            Folder(str(self.record)).write_atomic(
                PROGRESS_FILE, json.dumps(values, allow_nan=False)
            )
        except (OSError, ValueError):  # the table shows no progress for this run; the run goes on
            self.record = None

    def line(self, text: str) -> None:
        """A line of its own (epoch results, evaluations), clearing a live line first."""
        if not self.enabled:
            return
        if self.live and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def epoch_done(self, epoch: int, epochs: int, values: Mapping[str, Any]) -> None:
        self.line(f"epoch {epoch}/{epochs}: {format_metrics(values)}")


def show_progress(
    trainer: Any,
    epoch: int,
    epochs: int,
    done: int,
    total: Optional[int],
    mean_loss: Any,
    samples: int,
    batches: int,
    started: float,
) -> None:
    """The Trainer's progress line with its ETA (the epochs left, or ``max_steps``, whichever ends first)."""
    settings = trainer.settings
    elapsed = max(time.monotonic() - started, 1e-9)
    per_batch = elapsed / max(batches, 1)
    eta = None
    steps = None
    if total:
        eta = ((total - done) + (epochs - epoch - 1) * total) * per_batch
    if settings.max_steps is not None:
        left = (settings.max_steps - trainer.state.global_step) * settings.accumulate * per_batch
        if eta is None or left < eta:  # max_steps ends the run first: the bar counts its steps
            eta, steps = left, (trainer.state.global_step, settings.max_steps)
    rate = samples * trainer.run.dp_size / elapsed * settings.items_per_sample
    trainer.progress.update(
        epoch + 1, epochs, done, total, mean_loss.item(), rate, eta, settings.throughput_unit, steps
    )


def start_report(
    run: Any, settings: Any, model: Any, loader: Any, strategy: str, precision: str
) -> list[str]:
    """The two lines rank 0 prints before the first step: the global batch, and what trains on what."""
    params = list(model.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    # pp: every stage's, counted at setup
    total, trainable = getattr(model, "whole_model_parameters", None) or (
        sum(p.numel() for p in params),
        sum(p.numel() for p in params if p.requires_grad),
    )
    shard = f", {local:,} on this rank" if local != total else ""
    length = loader.length
    per_epoch = (
        f"{-(-length // settings.accumulate):,} optimizer steps per epoch"
        if length
        else "steps per epoch: unknown (a stream)"
    )
    return [
        f"multigpu: {run.describe_batch(loader.batch_size, settings.accumulate, loader.samples)}",
        f"multigpu: {total:,} parameters ({trainable:,} trainable{shard}); strategy {strategy}, "
        f"precision {precision}{', compiled' if settings.compile else ''}{_checkpointing(settings)}; {per_epoch}; "
        f"world {run.world_size} on {run.device.type}",
    ]


def _checkpointing(settings: Any) -> str:
    # False or {"blocks": ..., "every": ...}
    ac = getattr(settings, "activation_checkpointing", False)
    if not ac or not isinstance(ac, Mapping):
        return ""
    which = f"{', '.join(ac['blocks'])} blocks" if ac.get("blocks") else "repeated blocks"
    return f", activation checkpointing of {which}" + (
        f" (every {ac['every']})" if ac.get("every", 1) > 1 else ""
    )
