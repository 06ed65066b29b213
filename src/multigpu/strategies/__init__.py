"""How a model and optimizer are wrapped: a table of strategies, looked up by name.

Each strategy module exports ``STRATEGIES``: entries with a name, an options dataclass and a
``build(context, options)`` (:class:`~multigpu.strategies.base.StrategySpec`). This module only knows
where each name lives (the model-parallel modules load when asked for) and the rules that hold for
every entry: unknown names and options are errors with the nearest name, and strategies that keep no
replicas in sync are refused in a multi-process job. No strategy imports ``launch``: who starts the
processes is not their business. Learned from Lightning Fabric's strategy registry.

``auto`` is a rule, not a strategy: **ddp when the job has several processes, single otherwise** - and
in a job of replica groups (``multigpu run --replica-groups R``) ``auto`` and ``ddp`` mean **ft-ddp**,
the only strategy that keeps stepping when a group dies.
With ``pp`` > 1 the name says how each pipeline stage is wrapped within its ranks: ``ddp`` (and
``auto``), ``fsdp``, ``hsdp``, ``fsdp+tp`` become ``pp+ddp``, ``pp+fsdp``, ... (strategies/pipeline_parallel.py).

To add a strategy: write a module with a class following :class:`Strategy` and a ``STRATEGIES``
tuple, and add its names to :data:`MODULES` below.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional, Sequence

import torch

from multigpu.checkpoint.names import clean_state_dict
from multigpu.config import check_keys, from_mapping
from multigpu.distributed.parallel import Parallelism
from multigpu.distributed.world import World
from multigpu.errors import ConfigError, shown
from multigpu.strategies.base import (
    BuildContext,
    PlainGradients,
    Strategy,
    StrategySpec,
    unwrap_module,
)
from multigpu.strategies.ddp import DDP, DDPOptions
from multigpu.strategies.dp import DataParallelStrategy, split_sizes
from multigpu.strategies.single import SingleDevice

#: Where each strategy is defined (imported on first use).
MODULES = {
    "single": "multigpu.strategies.single",
    "dp": "multigpu.strategies.dp",
    "ddp": "multigpu.strategies.ddp",
    "fsdp": "multigpu.strategies.fsdp",
    "hsdp": "multigpu.strategies.fsdp",
    "fsdp+tp": "multigpu.strategies.fsdp",
    "pipeline": "multigpu.strategies.pipeline",
    "ddp+pipeline": "multigpu.strategies.pipeline",
    "ft-ddp": "multigpu.strategies.fault_tolerant",
    "pp+ddp": "multigpu.strategies.pipeline_parallel",
    "pp+fsdp": "multigpu.strategies.pipeline_parallel",
    "pp+hsdp": "multigpu.strategies.pipeline_parallel",
    "pp+fsdp+tp": "multigpu.strategies.pipeline_parallel",
}
NAMES = ("auto", *MODULES)


def resolve_name(name: Optional[str], world: World, pp: int = 1) -> str:
    """The documented ``auto`` rule, and names in lower case; with ``pp`` > 1 the pipelined entry."""
    name = (name or "auto").lower()
    if world.lighthouse is not None and name in ("auto", "ddp"):
        return "ft-ddp"
    if name == "auto":
        name = "ddp" if world.is_distributed else "single"
    if pp > 1 and not name.startswith("pp+") and "pp+" + name in MODULES:
        return "pp+" + name
    if pp > 1 and not name.startswith("pp+") and name in MODULES:
        raise ConfigError(
            f"strategy {name!r} does not run pipeline stages across processes (pp={pp}).",
            "use strategy ddp, fsdp, hsdp or fsdp+tp with pp (each stage wrapped that way), or pp: 1.",
        )
    return name


def spec(name: str) -> StrategySpec:
    """The table entry called ``name``."""
    module = MODULES.get(name)
    if module is None:
        from difflib import get_close_matches

        close = get_close_matches(name, NAMES, n=1)
        raise ConfigError(
            f"unknown strategy {name!r}.",
            (f"did you mean {close[0]!r}? " if close else "")
            + f"choose one of: {', '.join(NAMES)}.",
        )
    spec: StrategySpec = next(
        s for s in importlib.import_module(module).STRATEGIES if s.name == name
    )
    return spec


def parse_options(entry: StrategySpec, options: dict[str, Any]) -> Any:
    """``strategy_options`` as the strategy's options dataclass: every value typed and bounded by its field
    (``config.from_mapping``), before torch sees it (a string where DDP wants a number of megabytes became a
    1.1 GB string per rank)."""
    if not isinstance(options, dict):
        raise ConfigError(
            f"strategy_options must be a mapping of option names to values, not {shown(options)}.",
            "write strategy_options: {bucket_cap_mb: 25}.",
        )
    check_keys(entry.options, options, owner=f"strategy {entry.name!r}", noun="option")
    return from_mapping(
        entry.options, options, f"strategy {entry.name!r}", path=("strategy_options",)
    )


def make_strategy(
    name: Optional[str],
    world: World,
    devices: Sequence[torch.device],
    *,
    parallelism: Optional[Parallelism] = None,
    mesh: Optional[Callable[[], Any]] = None,
    activation_checkpointing: Any = None,
    **options: Any,
) -> Strategy:
    """The strategy called ``name`` for this process (``auto``: ddp with several processes, else single).
    ``activation_checkpointing``: the validated setting, applied by the strategy's ``setup``."""
    entry = spec(resolve_name(name, world, parallelism.pp if parallelism is not None else 1))
    if world.lighthouse is not None and not entry.fault_tolerant:
        raise ConfigError(
            f"strategy {entry.name!r} cannot run in replica groups: one dead group would stop the "
            "others, and its gradients would not be averaged across groups.",
            "use strategy ft-ddp (or leave strategy unset), or launch without --replica-groups.",
        )
    if world.is_distributed and not entry.in_sync:
        raise ConfigError(
            f"strategy {entry.name!r} keeps no replicas in sync, but this job has {world.world_size} processes: each "
            "would train its own model on its own shard.",
            f"use strategy {entry.instead}, or launch a single process.",
        )
    context = BuildContext(
        world=world,
        devices=list(devices),
        parallelism=parallelism or Parallelism.plain(world.world_size),
        mesh=mesh or _no_mesh,
    )
    strategy = entry.build(context, parse_options(entry, options))
    if activation_checkpointing:
        from multigpu.validate import activation_checkpointing_settings

        if not isinstance(strategy, PlainGradients):  # where checkpoint_activations lives
            raise ConfigError(
                f"strategy {entry.name!r} does not apply activation_checkpointing yet.",
                "leave activation_checkpointing off with it (see docs/strategies.md).",
            )

        strategy.activation_checkpointing = activation_checkpointing_settings(
            activation_checkpointing, ConfigError
        )
    return strategy


def _no_mesh() -> Any:
    raise ConfigError(
        "this strategy needs a device mesh, which only mg.init()'s Run provides.",
        "call run.setup(model, optimizer) instead of building the strategy by hand.",
    )


def describe() -> list[tuple[str, str]]:
    """(name, one line) for every strategy, for ``--help`` texts and docs."""
    return [(name, spec(name).summary) for name in MODULES]


__all__ = [
    "DDP",
    "DDPOptions",
    "DataParallelStrategy",
    "NAMES",
    "SingleDevice",
    "Strategy",
    "StrategySpec",
    "clean_state_dict",
    "make_strategy",
    "resolve_name",
    "spec",
    "split_sizes",
    "unwrap_module",
]
