"""``pp`` > 1: the model's stages on consecutive groups of ranks, run by ``torch.distributed.pipelining``;
within each stage the layers are wrapped the way the whole model would be - ``ddp``, ``fsdp``, ``hsdp``
or ``fsdp+tp`` over the stage's ranks (3D with tp).

Why: a model that does not fit one node's memory even with FSDP and tensor parallelism, or nodes joined
by a slow link, need stages on different processes: then only one activation per micro-batch crosses
between stages (point to point), while FSDP's all-gathers and tensor parallelism's all-reduces stay
inside a stage's ranks. Learned from torchtitan (``distributed/pipeline_parallel.py``: stages on the
mesh's ``pp`` dimension, each model part parallelized like a whole model, the schedule's ``step`` in
place of forward and backward) and torch's own pipelining (``PipelineStage``, ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``).

Layout (:mod:`multigpu.distributed.parallel`): stage group s is ranks ``s * world/pp`` to
``(s + 1) * world/pp - 1``. A rank holds one stage (``gpipe``, ``1f1b``) or several (``interleaved_1f1b``:
stages s, s + pp, s + 2pp, ... - torch's "loop" order; 2 per rank unless ``split_points`` give more).

The split: the children of an ``nn.Sequential``, at ``split_points`` (the names, or indexes, of the
children where a new stage begins) or balanced by parameter count (the exact split of the in-process
``pipeline``). Each stage is an ``nn.Sequential`` of the original children under their original names,
and the model handed back (:class:`~multigpu.strategies.schedules.PipelineParts`) holds this rank's
children under those names: checkpoint keys are the unsplit model's, so DCP shards written per stage
load at any layout and ``multigpu checkpoint consolidate`` gives the plain ``state.pt``. Every rank
builds the whole model (on the CPU); only its own stages move to its device, where the ranks of a stage
take its first rank's weights (as DDP's replicas take rank 0's).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from multigpu.checkpoint.names import strip_name
from multigpu.errors import ConfigError, MultiGPUError
from multigpu.strategies.base import BuildContext, OptimizerLike, StrategySpec, build_optimizer
from multigpu.strategies.fsdp import (
    FSDPOptions,
    FSDPTPOptions,
    _dtype,
    _sum_reductions_over_gloo,
    find_blocks,
)
from multigpu.strategies.pipeline import balanced_split_points
from multigpu.strategies.schedules import SCHEDULES, PipelineParts, StageRunner, check_micro_batches


@dataclass(frozen=True)
class ScheduleOptions:
    """Given by the Trainer settings ``pipeline_schedule``, ``micro_batches``, ``split_points``."""

    #: gpipe (all forwards, then all backwards), 1f1b (one forward, one backward), interleaved_1f1b.
    schedule: str = "1f1b"
    #: Micro-batches per batch (None: one per stage of the pipeline).
    micro_batches: Optional[int] = None
    #: Names (or indexes) of the Sequential's children where a new stage begins; None: balanced by parameters.
    split_points: Optional[Sequence[Union[int, str]]] = None


@dataclass(frozen=True)
class PPFSDPOptions(FSDPOptions, ScheduleOptions):
    pass


@dataclass(frozen=True)
class PPFSDPTPOptions(FSDPTPOptions, ScheduleOptions):
    pass


def stage_bounds(
    names: Sequence[str],
    sizes: Sequence[int],
    stages: int,
    split_points: Optional[Sequence[Union[int, str]]],
) -> list[tuple[int, int]]:
    """``(start, end)`` child indexes of each stage: at ``split_points`` (names or indexes of the children
    that begin a stage) or balanced by parameter count."""
    if split_points is None:
        if stages > len(names):
            raise ConfigError(
                f"{stages} pipeline stages need at least {stages} children in the model; it has "
                f"{len(names)}.",
                "lower pp, or split the model into more children.",
            )
        points = balanced_split_points(sizes, stages)
    else:
        points = [_child_index(point, names) for point in split_points]
        if (
            sorted(points) != points
            or len(set(points)) != len(points)
            or not all(0 < p < len(names) for p in points)
        ):
            raise ConfigError(
                f"split_points {list(split_points)} must name children in increasing order, after the "
                "first.",
                f"the children are {', '.join(names[:12])}; e.g. split_points: "
                f"[{names[len(names) // 2]!r}].",
            )
        if len(points) + 1 != stages:
            raise ConfigError(
                f"{len(points)} split point(s) make {len(points) + 1} stages, but the pipeline has "
                f"{stages}.",
                f"give {stages - 1} split point(s) (pp x stages per rank - 1), or none.",
            )
    edges = [0, *points, len(names)]
    bounds = list(zip(edges, edges[1:], strict=False))
    for stage, (start, end) in enumerate(bounds):
        # its optimizer would have nothing to step: torch fails deep inside
        if not sum(sizes[start:end]):
            raise ConfigError(
                f"pipeline stage {stage} ({', '.join(names[start:end][:6])}) owns no parameters.",
                "give every stage a layer with weights: move the split_points, lower pp, or merge the "
                "parameter-free layers (activations, dropout) into their neighbours.",
            )
    return bounds


def _child_index(point: Union[int, str], names: Sequence[str]) -> int:
    if isinstance(point, int) and not isinstance(point, bool) and 0 <= point < len(names):
        return point
    if isinstance(point, str) and point in names:
        return names.index(point)
    from difflib import get_close_matches

    close = get_close_matches(str(point), names, n=1)
    raise ConfigError(
        f"split point {point!r} is not a child of the model.",
        (f"did you mean {close[0]!r}? " if close else "")
        + f"the children: {', '.join(names[:12])}.",
    )


def stages_per_rank(schedule: str, pp: int, split_points: Optional[Sequence[Any]]) -> int:
    """1 for gpipe and 1f1b; for interleaved_1f1b 2, or what ``split_points`` make (a multiple of pp)."""
    if split_points is None:
        return 2 if schedule == "interleaved_1f1b" else 1
    stages = len(split_points) + 1
    if stages % pp:
        raise ConfigError(
            f"{len(split_points)} split point(s) make {stages} stages, which pp={pp} ranks cannot "
            "hold equally.",
            f"give a multiple of {pp} stages (split points = stages - 1).",
        )
    per_rank = stages // pp
    if per_rank > 1 and schedule != "interleaved_1f1b":
        raise ConfigError(
            f"{stages} stages on pp={pp} ranks is {per_rank} per rank; pipeline_schedule {schedule} "
            "runs one stage per rank.",
            f"give {pp - 1} split point(s), or use interleaved_1f1b.",
        )
    if per_rank == 1 and schedule == "interleaved_1f1b":
        raise ConfigError(
            "interleaved_1f1b needs at least 2 stages per rank.",
            f"give {2 * pp - 1} split points, or use pipeline_schedule 1f1b.",
        )
    return per_rank


class PipelineParallel:
    """Splits the model, wraps each of this rank's stages for its data-parallel ranks, and hands back a
    :class:`PipelineParts` whose ``train_step`` runs the schedule (the Trainer calls it)."""

    sharded = True

    def __init__(self, context: BuildContext, options: Any, wrap: str) -> None:
        self.name = f"pp+{wrap}"
        self.wrap = wrap
        self.context = context
        self.options = options
        if options.schedule not in SCHEDULES:
            raise ConfigError(
                f"pipeline_schedule {options.schedule!r} is not one of {', '.join(SCHEDULES)}.",
                "1f1b keeps fewer activations than gpipe; interleaved_1f1b has the smallest bubble.",
            )
        par = context.parallelism
        self.per_rank = stages_per_rank(options.schedule, par.pp, options.split_points)
        self.stages = par.pp * self.per_rank
        self.micro_batches = options.micro_batches or self.stages
        if not 1 <= self.micro_batches <= 4096:
            raise ConfigError(
                f"micro_batches={self.micro_batches} must be from 1 to 4096.",
                "e.g. micro_batches: 8.",
            )
        check_micro_batches(options.schedule, self.micro_batches, par.pp)
        self.device = context.device
        self.mesh: Any = None
        self.parts: Optional[PipelineParts] = None

    def setup(
        self, model: nn.Module, optimizer: OptimizerLike = None
    ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        if not isinstance(model, nn.Sequential):
            raise ConfigError(
                f"pp splits an nn.Sequential into stages, not {type(model).__name__}.",
                "express the model as nn.Sequential(...) of its layers (see examples/char_gpt).",
            )
        par, rank = self.context.parallelism, self.context.world.rank
        self.mesh = self.context.mesh()
        names = {id(p): n for n, p in model.named_parameters()}
        blocks = [
            dist.new_group([s * par.stage_size + r for r in range(par.stage_size)])
            for s in range(par.pp)
        ]
        children = OrderedDict(model.named_children())
        bounds = stage_bounds(
            list(children),
            [sum(p.numel() for p in c.parameters()) for c in children.values()],
            self.stages,
            self.options.split_points,
        )
        plan = self._tensor_parallel_plan(model)
        # torch's "loop" order
        mine = [par.pp_rank(rank) + k * par.pp for k in range(self.per_rank)]
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        wrapped = []
        for index in mine:
            part = OrderedDict(list(children.items())[bounds[index][0] : bounds[index][1]])
            layers.update(part)
            stage = nn.Sequential(part)
            if not getattr(self.options, "cpu_offload", False):
                stage.to(self.device)  # only this rank's stages reach its device
                # replicas (and tensor-parallel slices) start from one copy, as DDP's do
                if par.stage_size > 1:
                    _same_weights_as_first(stage, blocks[par.pp_rank(rank)])
            wrapped.append(self._wrap(stage, plan))
        # their gradients averaged after each step
        replicas = self.wrap == "ddp" and par.dp_size > 1
        runner = StageRunner(
            wrapped,
            mine,
            self.stages,
            self.device,
            self.mesh["pp"].get_group(),
            self.options.schedule,
            self.micro_batches,
            order=list(children),
            stage_size=par.stage_size,
            rank=rank,
            average_over=self.mesh["dp_shard"].get_group() if replicas else None,
        )
        self.parts = parts = PipelineParts(layers, runner)
        if isinstance(optimizer, torch.optim.Optimizer):
            return parts, _local_optimizer(optimizer, names, parts)
        return parts, build_optimizer(optimizer, parts)

    # ------------------------------------------------------------------ each stage within its ranks
    def _tensor_parallel_plan(self, model: nn.Module) -> dict[str, str]:
        if self.context.parallelism.tp == 1:
            return {}
        from multigpu.strategies.tensor_parallel import resolve_plan

        # checked against the whole model
        return resolve_plan(model, getattr(self.options, "tp_plan", None))

    def _wrap(self, stage: nn.Sequential, plan: dict[str, str]) -> nn.Module:
        # replicas, equal from rank 0's weights; the runner averages their gradients
        if self.wrap == "ddp":
            return stage
        return self._shard(stage, plan)

    def _shard(self, stage: nn.Sequential, plan: dict[str, str]) -> nn.Module:
        """fsdp, hsdp, fsdp+tp on one stage: tensor parallelism over ``tp`` for the planned layers this
        stage holds, then FSDP2 per block and on the stage, over the stage's data-parallel ranks."""
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        mine = {name: style for name, style in plan.items() if name.split(".")[0] in stage._modules}
        if mine:
            from multigpu.strategies.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(stage, self.mesh["tp"], mine)
        o = self.options
        data = (
            self.mesh["dp_replicate", "dp_shard"]
            if self.context.parallelism.dp_replicate > 1
            else self.mesh["dp_shard"]
        )
        kwargs = {
            "mesh": data,
            "reshard_after_forward": o.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=_dtype(o.param_dtype, "param_dtype"),
                reduce_dtype=_dtype(o.reduce_dtype, "reduce_dtype"),
            ),
            "offload_policy": CPUOffloadPolicy() if o.cpu_offload else OffloadPolicy(),
        }
        for block in find_blocks(stage, o.wrap):
            fully_shard(block, **kwargs)
        fully_shard(stage, **kwargs)
        _sum_reductions_over_gloo(stage)
        return stage

    # ------------------------------------------------------------------ the Strategy protocol
    def backward(self, loss: torch.Tensor) -> None:
        raise MultiGPUError(
            "with pp the pipeline schedule runs forward and backward together: there is no loss to "
            "call backward on.",
            "use the Trainer, or model.train_step(batch, loss_of) in your loop.",
        )

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        """pp+ddp: no gradient averaging until the accumulation boundary (FSDP's reduce-scatter runs
        inside the schedule's step, as torch's pipelining drives it)."""
        return (
            _no_averaging(model.runner)
            if isinstance(model, PipelineParts)
            else contextlib.nullcontext()
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model: per mesh within the stage (DTensor shards over dp and tp),
        then summed in squares over the stages of the pipeline - every rank clips by the same norm."""
        from collections import defaultdict

        groups: dict[Any, list[nn.Parameter]] = defaultdict(list)
        for p in model.parameters():
            if p.grad is not None:
                groups[getattr(p.grad, "device_mesh", None)].append(p)
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for params in groups.values():
            norm = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            squares += norm.to(squares.device, torch.float64) ** 2
        dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        total = squares.sqrt()
        for params in groups.values():
            nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


def _same_weights_as_first(module: nn.Module, group: Any) -> None:
    """Every rank of ``group`` takes its first rank's parameters and buffers: a stage built differently on
    one rank (another seed) would otherwise train a mixture under FSDP, or diverging replicas."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.numel():
            by_dtype.setdefault(tensor.dtype, []).append(tensor.data)
    with torch.no_grad():
        for tensors in by_dtype.values():
            flat = _flatten_dense_tensors(tensors)
            dist.broadcast(flat, group=group, group_src=0)
            for tensor, value in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                tensor.copy_(value)


@contextlib.contextmanager
def _no_averaging(runner: StageRunner) -> Iterator[None]:
    runner.sync = False
    try:
        yield
    finally:
        runner.sync = True


def _local_optimizer(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], parts: nn.Module
) -> torch.optim.Optimizer:
    """The optimizer given, rebuilt on this rank's stage parameters (the others live on other ranks)."""
    new_params = dict(parts.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        params = [
            new_params[name]
            for p in group["params"]
            if (name := strip_name(old_names[id(p)])) in new_params
        ]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return type(optimizer)(groups, **optimizer.defaults)


def _build(wrap: str) -> Any:
    def build(context: BuildContext, options: Any) -> PipelineParallel:
        par = context.parallelism
        if par.pp < 2:
            raise ConfigError(
                f"strategy pp+{wrap} needs pp of 2 or more; it is {par.pp}.",
                f"set pp (e.g. pp: 2), or use strategy {wrap}.",
            )
        if wrap == "ddp" and (par.tp > 1 or par.dp_replicate > 1):
            raise ConfigError(
                f"ddp keeps a whole replica of each stage on its ranks, but the degrees are "
                f"{par.describe()}.",
                "use strategy fsdp+tp for tp, hsdp for dp_replicate.",
            )
        if wrap == "hsdp" and par.dp_replicate < 2:
            raise ConfigError(
                f"hsdp needs dp_replicate of 2 or more; it is {par.dp_replicate}.",
                "set dp_replicate, or use strategy fsdp.",
            )
        if par.tp > 1 and wrap != "fsdp+tp":
            raise ConfigError(
                f"tp={par.tp} needs strategy fsdp+tp (strategy {wrap} does not split layers).",
                "set strategy: fsdp+tp, or tp: 1.",
            )
        return PipelineParallel(context, options, wrap)

    return build


STRATEGIES = (
    StrategySpec(
        "pp+ddp",
        ScheduleOptions,
        _build("ddp"),
        sharded=True,
        summary="pipeline stages on groups of ranks (pp), replicated over each stage's data-parallel ranks",
    ),
    StrategySpec(
        "pp+fsdp",
        PPFSDPOptions,
        _build("fsdp"),
        sharded=True,
        summary="pipeline stages on groups of ranks (pp), FSDP2 over each stage's data-parallel ranks",
    ),
    StrategySpec(
        "pp+hsdp",
        PPFSDPOptions,
        _build("hsdp"),
        sharded=True,
        summary="pipeline stages (pp), each sharded within dp_shard ranks and replicated across dp_replicate",
    ),
    StrategySpec(
        "pp+fsdp+tp",
        PPFSDPTPOptions,
        _build("fsdp+tp"),
        sharded=True,
        summary="3D: pipeline stages (pp) x FSDP2 (data-parallel ranks) x tensor parallel (tp)",
    ),
)
