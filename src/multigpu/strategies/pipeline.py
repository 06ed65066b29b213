"""``pipeline`` and ``ddp+pipeline``: a model split across the devices of one process, micro-batched
so the devices work at the same time (GPipe's forward schedule), optionally replicated with DDP.

Why in one process: this is the model parallelism of the blog post "Use Multiple GPUs" (its two-GPU split): the
model does not fit on one GPU, so its layers are spread over K GPUs that one process drives. CUDA
runs asynchronously, so issuing stage s of micro-batch m right after stage s-1 of micro-batch m+1 keeps
every device busy; autograd runs the backward of each device on its own thread. On the CPU all stages
sit on the CPU: the same code path, without the overlap. ``ddp+pipeline`` wraps the split model in DDP
across processes (``multigpu run --gpus-per-proc K``): that post's "DDP combined with model parallel".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ContextManager, Optional, Sequence

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


@dataclass(frozen=True)
class PipelineOptions:
    #: Number of stages (default: one per device of the process; 2 on a CPU).
    stages: Optional[int] = field(default=None, metadata=bounds(1, 4096))
    #: Indexes of the children where a new stage starts, e.g. [4, 8]; default: balanced by parameters.
    split_points: Optional[Sequence[int]] = field(default=None, metadata=bounds(items=4096))
    #: Micro-batches per batch (1: no overlap, the plain split of that blog post).
    micro_batches: int = field(default=4, metadata=bounds(1, 4096))
    #: Bring the output back to the first device, where the labels are (False: leave it on the last).
    output_to_first_device: bool = True


def balanced_split_points(sizes: Sequence[int], stages: int) -> list[int]:
    """Contiguous groups of ``sizes`` (parameters per layer) whose largest total is as small as possible.

    Returns the start index of every stage after the first. Exact (dynamic programming), O(stages n^2).
    """
    n = len(sizes)
    if not 1 <= stages <= n:
        raise ConfigError(
            f"cannot split {n} layer(s) into {stages} stage(s).", f"use at most {n} stages."
        )
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for end in range(k, n + 1):
            for start in range(k - 1, end):
                cost = max(best[k - 1][start], prefix[end] - prefix[start])
                if cost < best[k][end]:
                    best[k][end], cut[k][end] = cost, start
    points, end = [], n
    for k in range(stages, 1, -1):
        end = cut[k][end]
        points.append(end)
    return sorted(points)


class PipelineModule(nn.Sequential):
    """The model's layers, stage by stage on their devices; ``forward`` streams micro-batches through
    the stages in a wavefront.

    It is an ``nn.Sequential`` of the original layers, so its state dict has the original names and a
    checkpoint loads into the unsplit model.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        bounds: Sequence[tuple[int, int]],
        devices: Sequence[torch.device],
        micro_batches: int = 4,
        output_to_first_device: bool = True,
    ) -> None:
        super().__init__(*layers)
        if len(bounds) != len(devices):
            raise ConfigError(
                f"{len(bounds)} stage(s) but {len(devices)} device(s).",
                "give one device per stage.",
            )
        if micro_batches < 1:
            raise ConfigError(
                f"micro_batches={micro_batches} must be at least 1.", "use 1 (no overlap) or more."
            )
        self.bounds = [tuple(b) for b in bounds]
        self.devices = list(devices)
        self.micro_batches = micro_batches
        self.output_to_first_device = output_to_first_device
        for (start, end), device in zip(self.bounds, self.devices, strict=True):
            for index in range(start, end):
                self[index].to(device)

    def stage(self, s: int, x: Any) -> Any:
        start, end = self.bounds[s]
        for index in range(start, end):
            x = self[index](x)
        return x

    @override
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        chunks = list(
            inputs.to(self.devices[0]).chunk(min(self.micro_batches, max(inputs.shape[0], 1)))
        )
        n_stages = len(self.bounds)
        activations: list[Any] = list(chunks)
        outputs: list[Any] = [None] * len(chunks)
        # Clock t: stage s works on micro-batch t - s. Later stages are issued first so that each
        # device's queue gets its next job as early as possible.
        for clock in range(len(chunks) + n_stages - 1):
            for s in range(min(clock, n_stages - 1), -1, -1):
                m = clock - s
                if 0 <= m < len(chunks):
                    y = self.stage(s, activations[m].to(self.devices[s], non_blocking=True))
                    if s == n_stages - 1:
                        outputs[m] = y
                    else:
                        activations[m] = y
        out = torch.cat(outputs)
        return out.to(self.devices[0]) if self.output_to_first_device else out


def split_model(
    model: Any, stages: int, split_points: Optional[Sequence[int]] = None
) -> tuple[list[nn.Module], list[tuple[int, int]]]:
    """Layers and ``(start, end)`` of each stage, from an ``nn.Sequential`` (split at ``split_points``
    or balanced by parameter count) or from a list with one module per stage."""
    if isinstance(model, (list, tuple, nn.ModuleList)):
        parts = list(model)
        if split_points is not None or len(parts) != stages:
            raise ConfigError(
                f"a list of {len(parts)} stage(s) cannot make {stages} stages.",
                f"set stages: {len(parts)}, or pass an nn.Sequential to be split.",
            )
        return parts, [(i, i + 1) for i in range(len(parts))]
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"the pipeline strategy splits an nn.Sequential or a list of stages, not {type(model).__name__}.",
            "express the model as nn.Sequential(...) of its layers, or pass a list with one module per stage.",
        )
    layers = list(model.children())
    if split_points is None:
        split_points = balanced_split_points(
            [sum(p.numel() for p in layer.parameters()) for layer in layers], stages
        )
    points = list(split_points)
    if (
        sorted(points) != points
        or len(set(points)) != len(points)
        or not all(0 < p < len(layers) for p in points)
    ):
        raise ConfigError(
            f"split_points {points} must increase strictly within 1..{len(layers) - 1}.",
            f"the model has {len(layers)} layers; e.g. split_points: [{len(layers) // 2}].",
        )
    if len(points) + 1 != stages:
        raise ConfigError(
            f"{len(points)} split point(s) make {len(points) + 1} stages, not {stages}.",
            "give stages - 1 split points, or drop one of the two settings.",
        )
    bounds = [0, *points, len(layers)]
    return layers, list(zip(bounds, bounds[1:], strict=False))


class Pipeline(PlainGradients):
    sharded = False

    def __init__(
        self,
        devices: Sequence[torch.device],
        options: PipelineOptions = PipelineOptions(),
        data_parallel: bool = False,
    ) -> None:
        #: One name per table entry: "ddp+pipeline" replicates the split model across processes.
        self.name = "ddp+pipeline" if data_parallel else "pipeline"
        gpus = [d for d in devices if d.type == "cuda"]
        stages = options.stages or (len(gpus) if gpus else 2)
        if gpus and stages > len(gpus):
            raise ConfigError(
                f"pipeline with {stages} stages needs {stages} GPUs but this process owns {len(gpus)} "
                f"({', '.join(str(d) for d in gpus)}).",
                f"launch with `multigpu run --gpus-per-proc {stages}`, or set stages: {len(gpus)}.",
            )
        self.devices = gpus[:stages] if gpus else [torch.device("cpu")] * stages
        self.options = options
        self.stages = stages
        self.data_parallel = data_parallel

    @property
    def device(self) -> torch.device:
        return self.devices[0]

    def setup(
        self, model: nn.Module, optimizer: OptimizerLike = None
    ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        layers, bounds = split_model(
            self.checkpoint_activations(model), self.stages, self.options.split_points
        )
        piped = PipelineModule(
            layers,
            bounds,
            self.devices,
            self.options.micro_batches,
            self.options.output_to_first_device,
        )
        if isinstance(optimizer, torch.optim.Optimizer):
            # Same Parameter objects, moved in place by .to(): the optimizer still holds them.
            built: Optional[torch.optim.Optimizer] = optimizer
        else:
            built = build_optimizer(optimizer, piped)
        if not self.data_parallel:
            return piped, built
        # A module spanning several devices: DDP takes no device_ids and reduces on each device.
        return DistributedDataParallel(piped, device_ids=None), built

    @override
    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        return (
            model.no_sync()
            if isinstance(model, DistributedDataParallel)
            else super().no_sync(model)
        )

    # clip_grad_norm (inherited): clip_grad_norm_ gathers the per-device norms onto the first device,
    # which is the norm of the whole model.


def _pipeline_only(context: BuildContext, options: PipelineOptions) -> Pipeline:
    return Pipeline(context.devices, options, data_parallel=False)


def _replicated(context: BuildContext, options: PipelineOptions) -> Pipeline:
    if not context.parallelism.is_plain:
        raise ConfigError(
            "ddp+pipeline replicates the split model on every process; tp and dp_replicate do not apply.",
            "set tp and dp_replicate back to 1.",
        )
    # One process: nothing to replicate - the pipeline alone.
    return Pipeline(context.devices, options, data_parallel=context.world.is_distributed)


STRATEGIES = (
    StrategySpec(
        "pipeline",
        PipelineOptions,
        _pipeline_only,
        in_sync=False,
        instead="ddp+pipeline",
        summary="the model's layers split over the GPUs of one process, micro-batched",
    ),
    StrategySpec(
        "ddp+pipeline",
        PipelineOptions,
        _replicated,
        summary="pipeline inside each process, DDP across processes (--gpus-per-proc K)",
    ),
)
