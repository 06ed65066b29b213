"""``fsdp``, ``hsdp`` and ``fsdp+tp``: FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters,
gradients and optimizer state sharded across ranks, gathered block by block for compute - over one
mesh dimension (fsdp), over (dp_replicate, dp_shard) as HSDP, or after tensor parallelism over ``tp``
(2D, see :mod:`multigpu.strategies.tensor_parallel`).

Why FSDP2 and not FSDP1: per-parameter sharding with DTensor, no flat-parameter wrapper, state dicts
that ``torch.distributed.checkpoint`` reshards to any world size, and the same ``nn.Module`` object
(names unchanged). Blocks are sharded one by one (found from the model's repeated submodules, or
named by the user) and then the root, so only one block is gathered at a time.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import nn
from typing_extensions import override

from multigpu.config import bounds
from multigpu.errors import ConfigError
from multigpu.strategies.base import (
    BuildContext,
    OptimizerLike,
    PlainGradients,
    StrategySpec,
    build_optimizer,
    rebuild_optimizer,
)

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class FSDPOptions:
    #: Class names of the blocks to shard one by one; None finds the model's repeated blocks.
    wrap: Optional[Sequence[str]] = field(default=None, metadata=bounds(items=1000))
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
        raise ConfigError(
            f"fsdp option {option}={name!r} is not a dtype.", f"use one of {', '.join(DTYPES)}."
        )
    return DTYPES[name]


def find_blocks(model: nn.Module, wrap: Optional[Sequence[str]] = None) -> list[nn.Module]:
    """The submodules to shard one by one: instances of ``wrap`` classes, or the repeated block class
    holding the most parameters (a transformer's layers, an MLP's linear layers)."""
    if wrap:
        names = set(wrap)
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if not found:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"fsdp wrap={list(wrap)} matches no submodule.",
                f"classes in this model: {', '.join(present)}.",
            )
        return _outermost(found)
    counts = Counter(type(m) for m in model.modules() if m is not model and _own_params(m))
    candidates = {
        cls
        for cls, n in counts.items()
        if n >= 2 and not issubclass(cls, (nn.ModuleList, nn.ModuleDict, nn.Sequential))
    }
    if not candidates:
        return []
    # A class whose instances mostly sit inside another repeated class (the Linear layers of a
    # transformer block) is a part, not a block: keep the outer one.
    inside: Counter[type[torch.nn.Module]] = Counter()
    for outer in model.modules():
        if type(outer) in candidates:
            for inner in outer.modules():
                if (
                    inner is not outer
                    and type(inner) in candidates
                    and type(inner) is not type(outer)
                ):
                    inside[type(inner)] += 1
    outer_classes = [cls for cls in candidates if inside[cls] * 2 <= counts[cls]] or list(
        candidates
    )

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
    """FSDP2 over the data-parallel part of the mesh: ``fsdp`` (one dimension), ``hsdp`` (shards within
    groups of ``dp_shard`` ranks, replicas across ``dp_replicate`` groups) and ``fsdp+tp`` (tensor
    parallelism over the ``tp`` dimension first, then FSDP over the data-parallel one: 2D)."""

    sharded = True

    def __init__(
        self,
        device: torch.device,
        options: FSDPOptions = FSDPOptions(),
        distributed: bool = True,
        mesh: Optional[Callable[[], Any]] = None,
        tp_plan: Optional[dict[str, Any]] = None,
        name: str = "fsdp",
    ) -> None:
        self.name = name
        self.device = device
        self.options = options
        #: False in a world of one: nothing to shard over, the model trains plainly - but checkpoints
        #: stay DCP shards, so a run can move between one process and many in both directions.
        self.distributed = distributed
        #: Gives the job's DeviceMesh (dp_replicate, dp_shard, tp) when the model is set up (building it
        #: is a collective); None: the default group, one dimension.
        self._mesh_provider = mesh
        self.mesh: Any = None
        self.tp_plan = tp_plan
        self._param_dtype = _dtype(options.param_dtype, "param_dtype")
        self._reduce_dtype = _dtype(options.reduce_dtype, "reduce_dtype")

    def _data_mesh(self) -> Any:
        if self.mesh is None:
            return None
        if self.mesh["dp_replicate"].size() > 1:
            # 2D: FSDP2 shards on the last, replicates on the first
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    def setup(
        self, model: nn.Module, optimizer: OptimizerLike = None
    ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        if not self.distributed:
            model = self.checkpoint_activations(model.to(self.device))
            return model, build_optimizer(optimizer, model)
        names = {id(p): n for n, p in model.named_parameters()}
        if self._mesh_provider is not None:
            self.mesh = self._mesh_provider()
        if not self.options.cpu_offload:
            model = model.to(self.device)
            _same_weights_as_rank0(model)
        if self.mesh is not None and self.mesh["tp"].size() > 1:
            from multigpu.strategies.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, self.mesh["tp"], self.tp_plan)
        # before checkpointing gives some blocks a subclass
        blocks = find_blocks(model, self.options.wrap)
        self.checkpoint_activations(model)  # after tensor parallelism, before sharding
        kwargs: dict[str, Any] = {
            "reshard_after_forward": self.options.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=self._param_dtype, reduce_dtype=self._reduce_dtype
            ),
            "offload_policy": CPUOffloadPolicy() if self.options.cpu_offload else OffloadPolicy(),
        }
        data_mesh = self._data_mesh()
        if data_mesh is not None:
            kwargs["mesh"] = data_mesh
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        _sum_reductions_over_gloo(model)
        if isinstance(optimizer, torch.optim.Optimizer):
            # The optimizer holds the old (unsharded) parameters: rebuild it on the sharded ones.
            return model, rebuild_optimizer(optimizer, names, model)
        return model, build_optimizer(optimizer, model)

    @override
    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        return _no_gradient_sync(model) if self.distributed else contextlib.nullcontext()

    @override
    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # Gradients are DTensor shards, possibly on two meshes (tensor-parallel layers on (dp, tp), the
        # others on dp): the norm is taken per mesh over every shard of every rank, then combined, so
        # all ranks clip by the same global norm.
        return clip_grad_norm_across_meshes(
            [p for p in model.parameters() if p.grad is not None], max_norm
        )


def _sum_reductions_over_gloo(model: nn.Module) -> None:
    """Over gloo (CPU processes, or processes sharing a GPU), FSDP2's gradient reduce-scatter uses SUM and
    divides itself: gloo's reduce-scatter ignored ReduceOp.AVG and summed in torch releases before the fix
    of pytorch/pytorch#162338, which would double gradients silently. Same result where AVG works."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # torch types nn.Module.__getattr__ as Tensor | Module


def clip_grad_norm_across_meshes(
    parameters: list[nn.Parameter], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``clip_grad_norm_`` for parameters that may be DTensors on different meshes (plain clip refuses to
    stack norms from different meshes). Returns the total norm as a plain tensor."""
    from collections import defaultdict

    groups: dict[Any, list[nn.Parameter]] = defaultdict(list)
    for p in parameters:
        groups[getattr(p.grad, "device_mesh", None)].append(p)
    norms = []
    for params in groups.values():
        norm = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not norms:
        return torch.zeros(())
    total: torch.Tensor = torch.linalg.vector_norm(
        torch.stack([n.to(norms[0].device) for n in norms]), norm_type
    )
    # inf: the norm alone (the step guard)
    for params in groups.values() if max_norm != float("inf") else ():
        nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _same_weights_as_rank0(model: nn.Module) -> None:
    """Start every rank from rank 0's weights, as DDP does: ``fully_shard`` keeps each rank's own slice of
    its own copy, so a model built differently on one rank (another seed) would train a mixture."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    tensors = [t.data for t in [*model.parameters(), *model.buffers()] if t.numel()]
    buckets: dict[tuple[Any, ...], list[list[torch.Tensor]]] = {}
    for tensor in tensors:  # one broadcast per ~64 MB of one dtype, not one per tensor
        groups = buckets.setdefault((tensor.dtype, tensor.device), [[]])
        if sum(t.numel() * t.element_size() for t in groups[-1]) > 64 << 20:
            groups.append([])
        groups[-1].append(tensor)
    with torch.no_grad():
        for groups in buckets.values():
            for group in groups:
                flat = _flatten_dense_tensors(group)
                dist.broadcast(flat, src=0)
                for tensor, value in zip(group, _unflatten_dense_tensors(flat, group)):
                    tensor.copy_(value)


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally: no reduce-scatter until the context ends."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]  # torch types nn.Module.__getattr__ as Tensor | Module: FSDP's method
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]  # torch types nn.Module.__getattr__ as Tensor | Module


@dataclass(frozen=True)
class FSDPTPOptions(FSDPOptions):
    #: Which Linear layers are split, by glob over module names: {"*.q": "colwise", "*.proj": "rowwise"}.
    #: Default: the model's own ``tp_plan`` attribute (the convention of Hugging Face transformers).
    tp_plan: Optional[dict[str, str]] = field(default=None, metadata=bounds(items=10_000))


def _build(name: str) -> Any:
    def build(context: BuildContext, options: FSDPOptions) -> FSDP:
        par = context.parallelism
        if name == "hsdp" and par.dp_replicate < 2 and context.world.is_distributed:
            raise ConfigError(
                f"hsdp needs dp_replicate of 2 or more; it is {par.dp_replicate}.",
                f"set dp_replicate (e.g. the number of nodes, {context.world.num_nodes}): shards within "
                "each group, replicas across groups.",
            )
        if par.tp > 1 and name != "fsdp+tp":
            raise ConfigError(
                f"tp={par.tp} needs strategy fsdp+tp (strategy {name} does not split layers).",
                "set strategy: fsdp+tp, or tp: 1.",
            )
        if not context.world.is_distributed:
            return FSDP(context.device, options, distributed=False, name=name)
        tp_plan = getattr(options, "tp_plan", None)
        return FSDP(
            context.device, options, distributed=True, mesh=context.mesh, tp_plan=tp_plan, name=name
        )

    return build


STRATEGIES = (
    StrategySpec(
        "fsdp",
        FSDPOptions,
        _build("fsdp"),
        sharded=True,
        summary="FSDP2: parameters, gradients and optimizer state sharded over every rank",
    ),
    StrategySpec(
        "hsdp",
        FSDPOptions,
        _build("hsdp"),
        sharded=True,
        summary="FSDP2 sharded within groups of dp_shard ranks, replicated across dp_replicate groups",
    ),
    StrategySpec(
        "fsdp+tp",
        FSDPTPOptions,
        _build("fsdp+tp"),
        sharded=True,
        summary="2D: tensor parallel over tp (within a node), FSDP2 over the data-parallel ranks",
    ),
)
