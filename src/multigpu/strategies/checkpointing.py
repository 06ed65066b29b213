"""Activation checkpointing: a block keeps only its inputs in forward and recomputes the rest in backward.

Why here, applied by the strategies: the order of model transforms matters, and only the strategy knows
where it wraps the model. Each strategy's ``setup`` calls :func:`apply` after tensor parallelism (the
layers are already split, so a recomputed block recomputes its shard) and before FSDP or DDP wrap the
model (torchtitan's order: TP, activation checkpointing, compile, FSDP - the Trainer's ``compile``
then compiles the wrapped model, as without checkpointing).

How: the block's class is swapped, in place, for a subclass whose ``forward`` runs the original one
under ``torch.utils.checkpoint`` (non-reentrant: works with DDP, FSDP2, ``no_sync`` and unused
parameters). FSDP2's ``fully_shard`` swaps classes the same way. Unlike a wrapper module (torch's
``checkpoint_wrapper``), nothing is renamed - parameter names, state dicts, checkpoints and the
optimizer stay exactly as without checkpointing - and the module objects stay the same, so the blocks
FSDP shards one by one are still found. Gradients are equal to the model's without it, bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

from torch import nn
from torch.utils.checkpoint import checkpoint

from multigpu.errors import ConfigError


class _Recomputed:
    """Mixed in before the block's own class: forward under ``torch.utils.checkpoint``."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)  # type: ignore[misc]


@functools.lru_cache(maxsize=None)
def recomputed_class(cls: type) -> type:
    """One subclass per block class (same name, so ``fsdp`` ``wrap: [Block]`` still finds it)."""
    return type(
        cls.__name__,
        (_Recomputed, cls),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
    )


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module, _Recomputed)


def choose_blocks(model: nn.Module, blocks: Optional[list[str]], every: int) -> list[nn.Module]:
    """The blocks to checkpoint: the outermost instances of the classes named in ``blocks``, or the
    model's repeated blocks (the rule that picks FSDP's units); then every ``every``-th of them, counting
    from 1 (torchtitan's ``every 2``: blocks 2, 4, 6, ...)."""
    from multigpu.strategies.fsdp import find_blocks

    if blocks:
        named = [m for m in model.modules() if type(m).__name__ in set(blocks) and m is not model]
        if not named:
            present = sorted({type(m).__name__ for m in model.modules()})[:12]
            raise ConfigError(
                f"activation_checkpointing blocks={list(blocks)} matches no submodule.",
                f"name classes of this model: {', '.join(present)}.",
            )
        inner = {id(c) for m in named for c in m.modules() if c is not m}
        found = [m for m in named if id(m) not in inner]
    else:
        found = find_blocks(model)
    if not found:
        raise ConfigError(
            "activation_checkpointing found no repeated blocks in the model.",
            "name the block class: activation_checkpointing: {blocks: [Block]}.",
        )
    if every > len(found):
        raise ConfigError(
            f"activation_checkpointing every={every} skips all {len(found)} block(s) "
            f"({type(found[0]).__name__}).",
            f"use every from 1 to {len(found)}.",
        )
    return [block for number, block in enumerate(found, start=1) if number % every == 0]


def apply(model: nn.Module, setting: Mapping[str, Any]) -> list[nn.Module]:
    """Checkpoint the chosen blocks of ``model`` in place; returns them. ``setting`` is the validated
    ``{"blocks": names or None, "every": N}`` (:func:`multigpu.validate.activation_checkpointing_settings`)."""
    chosen = choose_blocks(model, setting.get("blocks"), int(setting.get("every", 1)))
    for block in chosen:
        if not is_checkpointed(block):
            block.__class__ = recomputed_class(type(block))  # type: ignore[arg-type]  # a class is hashable (mypy: not type[Module])
    return chosen
