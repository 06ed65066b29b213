"""The best value of a monitored metric, and early stopping: decided the same on every rank.

Why no collective: the metric is already reduced exactly across ranks (sums and counts) before it gets
here, so every rank sees the same number and takes the same decision - the ranks agree without
talking. The tracker's state goes into every checkpoint, so a resumed run keeps its best-so-far and
its patience counter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from multigpu.errors import ConfigError


@dataclass
class BestTracker:
    monitor: str
    mode: str = "min"
    #: Evaluations without an improvement larger than ``min_delta`` before stopping (None: never stop).
    patience: Optional[int] = None
    min_delta: float = 0.0
    best: Optional[float] = None
    best_step: Optional[int] = None
    bad_evaluations: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ConfigError(
                f"mode={self.mode!r} must be 'min' or 'max'.",
                "min for a loss, max for an accuracy.",
            )
        if self.patience is not None and self.patience < 1:
            raise ConfigError(
                f"patience={self.patience} must be 1 or more (or null).", "e.g. patience: 5."
            )
        if self.min_delta < 0:
            raise ConfigError(
                f"min_delta={self.min_delta} must be 0 or more.", "e.g. min_delta: 0.001."
            )

    def value(self, metrics: Mapping[str, Any]) -> Optional[float]:
        """The monitored value in ``metrics`` (None if this evaluation did not produce it)."""
        value = metrics.get(self.monitor)
        if value is None:
            return None
        value = float(value)
        return None if math.isnan(value) else value

    def update(self, metrics: Mapping[str, Any], step: int) -> bool:
        """Record an evaluation; True if it is a new best."""
        value = self.value(metrics)
        if value is None:
            return False
        better = self.best is None or (
            value < self.best - self.min_delta
            if self.mode == "min"
            else value > self.best + self.min_delta
        )
        if better:
            self.best, self.best_step, self.bad_evaluations = value, step, 0
        else:
            self.bad_evaluations += 1
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.bad_evaluations >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("monitor") != self.monitor or state.get("mode") != self.mode:
            return  # a different metric or direction now: start afresh
        best, step, bad = (
            state.get("best"),
            state.get("best_step"),
            state.get("bad_evaluations") or 0,
        )
        if (
            (best is not None and not isinstance(best, (int, float)))
            or (step is not None and not isinstance(step, int))
            or not isinstance(bad, int)
            or bad < 0
        ):
            raise TypeError("malformed best-metric state")
        self.best, self.best_step, self.bad_evaluations = best, step, bad
