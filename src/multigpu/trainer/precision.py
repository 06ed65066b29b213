"""Mixed precision: bf16 autocast, or fp16 autocast with a gradient scaler.

Why its own small object: the Trainer and a hand-written loop need the same three moves (autocast the
forward, scale the loss, unscale before clipping and step through the scaler), and getting their
order wrong silently clips scaled gradients.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch

from multigpu.errors import ConfigError
from multigpu.trainer.settings import PRECISIONS as ALIASES


class Precision:
    def __init__(self, mode: str = "32", device: Optional[torch.device] = None) -> None:
        key = str(mode).lower()
        if key not in ALIASES:
            raise ConfigError(
                f"unknown precision {mode!r}.",
                "use '32', 'bf16' (bf16-mixed) or 'fp16' (16-mixed).",
            )
        self.mode = ALIASES[key]
        self.device = device if device is not None else torch.device("cpu")
        self.scaler: Optional[torch.amp.GradScaler] = None
        if self.mode == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)

    @property
    def dtype(self) -> Optional[torch.dtype]:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mode)

    def autocast(self) -> ContextManager[None]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Call before clipping, so the clip threshold applies to the true gradients."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Optimizer step (skipped by the fp16 scaler on inf/nan gradients). Returns True unless the
        optimizer itself says it did not step (``ft-ddp``'s returns False for a step the replica groups did
        not commit). Whether the scaler skipped it is only known by reading its scale, a host
        synchronisation on every step, so the scheduler advances on a skipped step too (as in Lightning) -
        a handful of steps at the start of an fp16 run."""
        if self.scaler is None:
            return optimizer.step() is not False
        stepped = self.scaler.step(optimizer)
        self.scaler.update()
        return stepped is not False

    def skip(self) -> bool:
        """No optimizer step this time (the step guard skipped it). After ``unscale`` the fp16 scaler still
        closes its step (``update``: a step with infs also lowers the scale), so the next one may unscale.
        Returns False: not stepped."""
        if self.scaler is not None:
            self.scaler.update()
        return False

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
