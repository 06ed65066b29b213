"""``ddp``: DistributedDataParallel, one replica per process, gradients averaged in buckets.

Batch size is per process (the PyTorch DDP tutorial's rule): the global batch is batch x processes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ContextManager, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from multigpu.config import bounds
from multigpu.errors import ConfigError
from multigpu.strategies.base import (
    BuildContext,
    OptimizerLike,
    PlainGradients,
    StrategySpec,
    build_optimizer,
)
from multigpu.strategies.single import SingleDevice


@dataclass(frozen=True)
class DDPOptions:
    #: Needed when some parameters get no gradient in a step (costs a graph walk per step).
    find_unused_parameters: bool = False
    #: The graph is the same every step: lets DDP skip work and support reentrant checkpointing.
    static_graph: bool = False
    #: Gradients share memory with the communication buckets (saves one copy of the gradients).
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: Optional[float] = field(default=None, metadata=bounds(1e-3, 1e6))
    #: None keeps torch's default (buffers such as BatchNorm statistics follow rank 0).
    broadcast_buffers: Optional[bool] = None


class DDP(PlainGradients):
    """After backward every replica holds the same averaged gradient, so the plain clip is global."""

    name = "ddp"
    sharded = False

    def __init__(self, device: torch.device, options: DDPOptions = DDPOptions()) -> None:
        self.device = device
        self.options = options

    def setup(
        self, model: nn.Module, optimizer: OptimizerLike = None
    ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        model = self.checkpoint_activations(model.to(self.device))
        kwargs = {k: v for k, v in asdict(self.options).items() if v is not None}
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # broadcasts rank 0's weights
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **kwargs)
        return wrapped, build_optimizer(optimizer, model)

    @override
    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        # DDP's own method; torch types nn.Module.__getattr__ as Tensor | Module
        sync: ContextManager[None] = model.no_sync()  # type: ignore[operator]
        return sync


def _build(context: BuildContext, options: DDPOptions) -> "DDP | SingleDevice":
    if not context.world.is_distributed:
        # DDP of one process is single-device training with extra copies
        return SingleDevice(context.device)
    if not context.parallelism.is_plain:
        raise ConfigError(
            f"ddp keeps a whole replica on every rank, but the degrees are "
            f"{context.parallelism.describe()}.",
            "use strategy fsdp+tp for tensor parallelism, hsdp for dp_replicate, or set tp and "
            "dp_replicate back to 1.",
        )
    return DDP(context.device, options)


STRATEGIES = (
    StrategySpec(
        "ddp", DDPOptions, _build, summary="DistributedDataParallel: a replica per process"
    ),
)
