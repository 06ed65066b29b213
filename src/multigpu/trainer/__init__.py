"""The Trainer: a short fit/evaluate loop over the Run, and what it is made of.

``loop``: the :class:`Trainer` (subclass it, implement ``compute_loss``); ``settings``: its typed
settings and counters; ``resume``: reconciling a checkpoint with the run that resumes it (pure
functions); ``batches``: moving and counting batches; ``precision``: bf16/fp16 and the loss scaler;
``monitor``: the best checkpoint and early stopping; ``progress``: the rank-0 progress line.
"""

from multigpu.trainer.batches import batch_length, move_to
from multigpu.trainer.loop import Trainer
from multigpu.trainer.settings import TrainerSettings, TrainState

__all__ = ["Trainer", "TrainerSettings", "TrainState", "batch_length", "move_to"]
