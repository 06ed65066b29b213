"""How a model and optimizer are wrapped: single, dp, ddp, fsdp, pipeline, ddp+pipeline.
``make_strategy`` turns a name from the config into one (the model-parallel ones load only when
asked for); no strategy imports ``launch``: who starts the processes is not their business.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from multigpu.errors import ConfigError
from multigpu.strategies.base import Strategy, clean_state_dict, unwrap_module
from multigpu.strategies.ddp import DDP, DDPOptions
from multigpu.strategies.dp import DataParallelStrategy, split_sizes
from multigpu.strategies.single import SingleDevice
from multigpu.world import World

NAMES = ("auto", "single", "dp", "ddp", "fsdp", "pipeline", "ddp+pipeline")


def _options(cls: type, strategy: str, options: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"strategy {strategy!r} has no option {unknown[0]!r}.",
            f"its options are: {', '.join(sorted(known)) or 'none'}.",
        )
    return cls(**options)


def make_strategy(name: str, world: World, devices: Sequence[torch.device], **options: Any) -> Strategy:
    """The strategy called ``name`` for this process. ``auto``: ddp with several processes, else single."""
    name = (name or "auto").lower()
    if name == "auto":
        name = "ddp" if world.is_distributed else "single"
    device = devices[0]
    if world.is_distributed and name in ("single", "dp", "pipeline"):
        instead = {"single": "ddp (or auto)", "dp": "ddp", "pipeline": "ddp+pipeline"}[name]
        raise ConfigError(
            f"strategy {name!r} keeps no replicas in sync, but this job has {world.world_size} processes: each "
            "would train its own model on its own shard.",
            f"use strategy {instead}, or launch a single process.",
        )
    if name == "single":
        _options(_NoOptions, name, options)
        return SingleDevice(device)
    if name == "ddp":
        if not world.is_distributed:
            # DDP of one process is single-device training with extra copies; say so instead of failing.
            _options(DDPOptions, name, options)
            return SingleDevice(device)
        return DDP(device, _options(DDPOptions, name, options))
    if name == "dp":
        _options(_NoOptions, name, options)
        ids = [d.index for d in devices if d.type == "cuda"]
        if len(ids) == 1:
            ids = list(range(torch.cuda.device_count()))  # a plain process: DataParallel over every GPU
        return DataParallelStrategy(ids)
    if name == "fsdp":
        from multigpu.strategies.fsdp import FSDP, FSDPOptions

        return FSDP(device, _options(FSDPOptions, name, options), distributed=world.is_distributed)
    if name in ("pipeline", "ddp+pipeline"):
        from multigpu.strategies.pipeline import Pipeline, PipelineOptions

        return Pipeline(devices, _options(PipelineOptions, name, options), data_parallel=world.is_distributed)
    raise ConfigError(f"unknown strategy {name!r}.", f"choose one of: {', '.join(NAMES)}.")


@dataclasses.dataclass(frozen=True)
class _NoOptions:
    pass


__all__ = ["DDP", "DDPOptions", "DataParallelStrategy", "SingleDevice", "Strategy", "clean_state_dict",
           "make_strategy", "split_sizes", "unwrap_module", "NAMES"]
