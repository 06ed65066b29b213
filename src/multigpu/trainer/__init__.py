"""The Trainer: a short fit/evaluate loop over the Run, and what it is made of.

``loop``: the :class:`Trainer` (subclass it, implement ``compute_loss``); ``settings``: its typed
settings and counters; ``resume``: reconciling a checkpoint with the run that resumes it (pure
functions); ``batches``: moving and counting batches; ``precision``: bf16/fp16 and the loss scaler;
``monitor``: the best checkpoint and early stopping; ``progress``: the rank-0 progress line.

The names below are imported on first use, so that the launcher can check a recipe's ``trainer:``
settings (``multigpu.trainer.settings``) before anything imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multigpu.trainer.batches import batch_length, move_to
    from multigpu.trainer.loop import Trainer
    from multigpu.trainer.settings import TrainerSettings, TrainState

_WHERE = {
    "Trainer": "loop",
    "TrainerSettings": "settings",
    "TrainState": "settings",
    "batch_length": "batches",
    "move_to": "batches",
}

__all__ = ["Trainer", "TrainerSettings", "TrainState", "batch_length", "move_to"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'multigpu.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"multigpu.trainer.{_WHERE[name]}"), name)
