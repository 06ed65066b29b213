"""``single``: one device, no wrapper. What ``auto`` picks when the world has one process."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from multigpu.strategies.base import (
    NoOptions,
    OptimizerLike,
    PlainGradients,
    StrategySpec,
    build_optimizer,
)


class SingleDevice(PlainGradients):
    name = "single"
    sharded = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def setup(
        self, model: nn.Module, optimizer: OptimizerLike = None
    ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        # in place: an optimizer built before still holds them
        model = self.checkpoint_activations(model.to(self.device))
        return model, build_optimizer(optimizer, model)


STRATEGIES = (
    StrategySpec(
        "single",
        NoOptions,
        lambda context, options: SingleDevice(context.device),
        in_sync=False,
        instead="ddp (or auto)",
        summary="one device, no wrapper",
    ),
)
