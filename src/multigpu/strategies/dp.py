"""``dp``: torch.nn.DataParallel over the GPUs of one process. Deprecated upstream; kept for recipes
written for it (SpeechBrain's multi-GPU guide still shows it). The batch from the loader is split
across the GPUs (``batch / n_gpus`` each), the opposite of ddp, where the batch is per process.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import torch
from torch import nn

from multigpu.strategies.base import (
    BuildContext,
    NoOptions,
    OptimizerLike,
    PlainGradients,
    StrategySpec,
    build_optimizer,
)

DEPRECATION = (
    "multigpu: strategy 'dp' (torch.nn.DataParallel) is deprecated and slower than 'ddp'; "
    "use `multigpu run train.py` with strategy 'ddp' (batch size is then per GPU)."
)


def split_sizes(batch_size: int, n_devices: int) -> list[int]:
    """How DataParallel splits a batch: chunks of ceil(B / n), so the last GPUs may get less or nothing."""
    if n_devices < 1 or batch_size < 0:
        raise ValueError("need at least one device and a non-negative batch")
    chunk = math.ceil(batch_size / n_devices) if batch_size else 0
    sizes = []
    left = batch_size
    while left > 0:
        sizes.append(min(chunk, left))
        left -= chunk
    return sizes


class DataParallelStrategy(PlainGradients):
    name = "dp"
    sharded = False

    def __init__(self, device_ids: Sequence[int]) -> None:
        self.device_ids = list(device_ids)
        warnings.warn(DEPRECATION, FutureWarning, stacklevel=3)
        if not self.device_ids:
            warnings.warn(
                "multigpu: strategy 'dp' needs GPUs; running on the CPU as 'single'.",
                UserWarning,
                stacklevel=3,
            )

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_ids[0]) if self.device_ids else torch.device("cpu")

    def setup(
        self, model: nn.Module, optimizer: OptimizerLike = None
    ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        model = self.checkpoint_activations(model.to(self.device))
        wrapped = (
            nn.DataParallel(model, device_ids=self.device_ids)
            if len(self.device_ids) > 1
            else model
        )
        return wrapped, build_optimizer(optimizer, model)


def _build(context: BuildContext, options: NoOptions) -> DataParallelStrategy:
    ids = [d.index for d in context.devices if d.type == "cuda"]
    if len(ids) == 1:
        ids = list(range(torch.cuda.device_count()))  # a plain process: DataParallel over every GPU
    return DataParallelStrategy(ids)


STRATEGIES = (
    StrategySpec(
        "dp",
        NoOptions,
        _build,
        in_sync=False,
        instead="ddp",
        summary="torch.nn.DataParallel over the GPUs of one process (deprecated)",
    ),
)
