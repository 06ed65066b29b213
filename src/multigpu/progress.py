"""A rank-0 progress line with samples/s, and the per-epoch CSV of metrics.

Why not a progress-bar library in the training step: a bar redrawn every step costs more than the
step of a small model; this one redraws at most every ``interval_s`` and only on a terminal. When the
output is a log file (Slurm, CI, ``multigpu queue``), it prints one line per epoch instead.
"""

from __future__ import annotations

import csv
import io
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional, TextIO


def format_metrics(values: Mapping[str, Any]) -> str:
    parts = []
    for key, value in values.items():
        if isinstance(value, float):
            parts.append(f"{key} {value:,.0f}" if abs(value) >= 1000 else f"{key} {value:.4g}")
        else:
            parts.append(f"{key} {value}")
    return ", ".join(parts)


class ProgressLine:
    def __init__(self, enabled: bool, stream: Optional[TextIO] = None, interval_s: float = 0.25) -> None:
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.interval_s = interval_s
        self._last = 0.0
        self._width = 0

    def update(self, epoch: int, epochs: int, done: int, total: int, loss: float, samples_per_s: float) -> None:
        if not self.live:
            return
        now = time.monotonic()
        if now - self._last < self.interval_s and done < total:
            return
        self._last = now
        filled = int(20 * done / max(total, 1))
        text = (f"epoch {epoch + 1}/{epochs} [{'=' * filled}{' ' * (20 - filled)}] {done}/{total} "
                f"loss {loss:.4g} {samples_per_s:,.0f} samples/s")
        self.stream.write("\r" + text.ljust(self._width))
        self._width = len(text)
        self.stream.flush()

    def wants_update(self) -> bool:
        return self.live and time.monotonic() - self._last >= self.interval_s

    def epoch_done(self, epoch: int, epochs: int, values: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        if self.live and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(f"epoch {epoch + 1}/{epochs}: {format_metrics(values)}\n")
        self.stream.flush()


def write_csv(path: Path, rows: list[Mapping[str, Any]]) -> None:
    """Rewrite the whole metrics file atomically (it is small): a crash never leaves half a row."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(buffer.getvalue())
    os.replace(tmp, path)


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))
