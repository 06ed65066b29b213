"""The one small Protocol every strategy follows, and the helpers they share.

Why a Protocol and flat classes: the references that grew inheritance trees of strategies (and
accelerators, and plugins) are hard to read; a strategy here is one file with a handful of methods.
Sharded strategies need model and optimizer set up together, so ``setup`` takes both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    ContextManager,
    Iterable,
    Optional,
    Protocol,
    Sequence,
    Union,
    runtime_checkable,
)

import torch
from torch import nn

from multigpu.checkpoint.names import strip_name
from multigpu.distributed.parallel import Parallelism
from multigpu.distributed.world import World

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
OptimizerLike = Union[torch.optim.Optimizer, OptimizerFactory, None]


@dataclass(frozen=True)
class BuildContext:
    """What a strategy may know about the job when it is built: never the launcher, never the environment."""

    world: World
    devices: Sequence[torch.device]
    parallelism: Parallelism
    #: The job's DeviceMesh (dp_replicate, dp_shard, tp), built on first call - a collective, so only
    #: strategies that need a mesh call it, and every rank builds the same strategy.
    mesh: Callable[[], Any]

    @property
    def device(self) -> torch.device:
        return self.devices[0]


@dataclass(frozen=True)
class StrategySpec:
    """One entry of the strategy table: a name, its options and how to build it.

    ``in_sync``: the replicas stay equal across processes (False for single/dp/pipeline: refused when
    the job has several processes). ``sharded``: each rank holds part of the state (checkpoints are
    DCP shards written by every rank, whatever the world size).
    """

    name: str
    options: type
    build: Callable[[BuildContext, Any], "Strategy"]
    in_sync: bool = True
    sharded: bool = False
    #: What to use instead when the strategy is refused for several processes.
    instead: str = ""
    summary: str = ""
    #: Keeps stepping when a replica group dies (torchft): the only kind a job with replica groups takes.
    fault_tolerant: bool = False


@runtime_checkable
class Strategy(Protocol):
    name: str
    #: True when each rank holds only part of the state (checkpoints are then written by every rank).
    sharded: bool

    def setup(
        self, model: nn.Module, optimizer: OptimizerLike = None
    ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        """Move/wrap the model for this strategy and build (or re-bind) the optimizer on its parameters."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        """Skip gradient synchronisation (accumulation micro-steps); a no-op where there is none."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module, without wrappers."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the *whole* model's gradient (across shards/stages), return that norm."""


@dataclass(frozen=True)
class NoOptions:
    """For strategies that take no options."""


class PlainGradients:
    """The moves every strategy shares unless it shards or syncs gradients its own way: a plain
    backward, nothing to skip for accumulation, peel the wrappers, clip by the local norm (which is
    the global one wherever every rank holds the whole, already averaged, gradient)."""

    #: The validated ``activation_checkpointing`` setting (None: off), set by ``make_strategy``; each
    #: ``setup`` applies it after tensor parallelism and before its wrapper (strategies/checkpointing.py).
    activation_checkpointing: Optional[dict[str, Any]] = None

    def checkpoint_activations(self, model: Any) -> Any:
        """``model`` with its chosen blocks checkpointed in place (a list of stages: its modules)."""
        if self.activation_checkpointing:
            from multigpu.strategies.checkpointing import apply

            apply(
                model if isinstance(model, nn.Module) else nn.ModuleList(model),
                self.activation_checkpointing,
            )
        return model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap_module(model)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # the norm alone (the step guard's): scaling by 1 would change nothing
        if max_norm == float("inf"):
            return nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None]
            )
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def unwrap_module(model: nn.Module) -> nn.Module:
    """Peel DDP/DP (``.module``) and torch.compile (``._orig_mod``) wrappers, in any order."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def build_optimizer(optimizer: OptimizerLike, model: nn.Module) -> Optional[torch.optim.Optimizer]:
    """An optimizer for ``model``'s current parameters: call a factory, or keep an instance."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        built = optimizer(model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            from multigpu.errors import MultiGPUError

            raise MultiGPUError(
                f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer.",
                "pass e.g. `lambda params: torch.optim.AdamW(params, lr=3e-4)`.",
            )
        return built
    raise TypeError(
        f"optimizer must be an Optimizer, a factory or None, not {type(optimizer).__name__}"
    )


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: nn.Module
) -> torch.optim.Optimizer:
    """Recreate an optimizer on a model whose parameters were replaced (sharding), keeping its groups.

    ``old_names`` maps ``id(old_param)`` to its name, taken before the model was transformed.
    """
    new_params = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        params = [new_params[strip_name(old_names[id(p)])] for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return type(optimizer)(groups, **optimizer.defaults)
