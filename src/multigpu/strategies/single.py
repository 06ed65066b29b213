"""``single``: one device, no wrapper. What ``auto`` picks when the world has one process."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch
from torch import nn

from multigpu.strategies.base import OptimizerLike, build_optimizer, unwrap_module


class SingleDevice:
    name = "single"
    sharded = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def setup(self, model: nn.Module, optimizer: OptimizerLike = None) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        model = model.to(self.device)  # in place: an optimizer built before this still holds the parameters
        return model, build_optimizer(optimizer, model)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def no_sync(self, model: nn.Module) -> ContextManager:
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap_module(model)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)
