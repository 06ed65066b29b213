"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state
sharded across ranks, gathered block by block for compute.

Why FSDP2 and not FSDP1: per-parameter sharding with DTensor, no flat-parameter wrapper, state dicts
that ``torch.distributed.checkpoint`` reshards to any world size, and the same ``nn.Module`` object
(names unchanged). Blocks are sharded one by one (found from the model's repeated submodules, or
named by the user) and then the root, so only one block is gathered at a time.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Optional, Sequence

import torch
from torch import nn

from multigpu.errors import ConfigError
from multigpu.strategies.base import OptimizerLike, PlainGradients, build_optimizer, rebuild_optimizer

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class FSDPOptions:
    #: Class names of the blocks to shard one by one; None finds the model's repeated blocks.
    wrap: Optional[Sequence[str]] = None
    #: Free gathered parameters after forward (less memory, one more all-gather in backward).
    reshard_after_forward: bool = True
    #: Mixed precision: dtype for compute/all-gather and for gradient reduce-scatter (None: as stored).
    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None
    #: Keep sharded parameters, gradients and optimizer state in CPU memory between uses.
    cpu_offload: bool = False


def _dtype(name: Optional[str], option: str) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in DTYPES:
        raise ConfigError(f"fsdp option {option}={name!r} is not a dtype.", f"use one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def find_blocks(model: nn.Module, wrap: Optional[Sequence[str]] = None) -> list[nn.Module]:
    """The submodules to shard one by one: instances of ``wrap`` classes, or the repeated block class
    holding the most parameters (a transformer's layers, an MLP's linear layers)."""
    if wrap:
        names = set(wrap)
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if not found:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(f"fsdp wrap={list(wrap)} matches no submodule.", f"classes in this model: {', '.join(present)}.")
        return _outermost(found)
    counts = Counter(type(m) for m in model.modules() if m is not model and _own_params(m))
    candidates = {cls for cls, n in counts.items()
                  if n >= 2 and not issubclass(cls, (nn.ModuleList, nn.ModuleDict, nn.Sequential))}
    if not candidates:
        return []
    # A class whose instances mostly sit inside another repeated class (the Linear layers of a
    # transformer block) is a part, not a block: keep the outer one.
    inside: Counter = Counter()
    for outer in model.modules():
        if type(outer) in candidates:
            for inner in outer.modules():
                if inner is not outer and type(inner) in candidates and type(inner) is not type(outer):
                    inside[type(inner)] += 1
    outer_classes = [cls for cls in candidates if inside[cls] * 2 <= counts[cls]] or list(candidates)

    def weight(cls: type) -> int:
        return sum(p.numel() for m in model.modules() if type(m) is cls for p in m.parameters())

    best = max(outer_classes, key=weight)
    return _outermost([m for m in model.modules() if type(m) is best])


def _own_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    inside = set()
    for m in modules:
        for child in m.modules():
            if child is not m:
                inside.add(id(child))
    return [m for m in modules if id(m) not in inside]


class FSDP(PlainGradients):
    name = "fsdp"
    sharded = True

    def __init__(self, device: torch.device, options: FSDPOptions = FSDPOptions(), distributed: bool = True) -> None:
        self.device = device
        self.options = options
        #: False in a world of one: nothing to shard over, the model trains plainly - but checkpoints
        #: stay DCP shards, so a run can move between one process and many in both directions.
        self.distributed = distributed
        self._param_dtype = _dtype(options.param_dtype, "param_dtype")
        self._reduce_dtype = _dtype(options.reduce_dtype, "reduce_dtype")

    def setup(self, model: nn.Module, optimizer: OptimizerLike = None) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if not self.distributed:
            model = model.to(self.device)
            return model, build_optimizer(optimizer, model)
        names = {id(p): n for n, p in model.named_parameters()}
        if not self.options.cpu_offload:
            model = model.to(self.device)
        kwargs: dict[str, Any] = {
            "reshard_after_forward": self.options.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(param_dtype=self._param_dtype, reduce_dtype=self._reduce_dtype),
            "offload_policy": CPUOffloadPolicy() if self.options.cpu_offload else OffloadPolicy(),
        }
        for block in find_blocks(model, self.options.wrap):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        if isinstance(optimizer, torch.optim.Optimizer):
            # The optimizer holds the old (unsharded) parameters: rebuild it on the sharded ones.
            return model, rebuild_optimizer(optimizer, names, model)
        return model, build_optimizer(optimizer, model)

    def no_sync(self, model: nn.Module) -> ContextManager:
        return _no_gradient_sync(model) if self.distributed else contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # Gradients are DTensor shards: clip_grad_norm_ computes the norm over every shard of every
        # rank (a reduction inside DTensor), so all ranks clip by the same global norm.
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally: no reduce-scatter until the context ends."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
