"""Tensor parallelism for ``fsdp+tp``: chosen Linear layers split across the ``tp`` ranks of a node.

Why Megatron's pairing: a column-parallel layer (each rank holds some output features) followed by a
row-parallel one (each rank holds the matching input features) needs one all-reduce per pair, in the
forward of the second - attention's q/k/v then its output projection, an MLP's two layers. Everything
else (embeddings, norms, the head) stays whole on every tp rank, so the loss is an ordinary tensor.
Built on ``torch.distributed.tensor.parallel`` (the same DTensor layouts torchtitan uses); the plan
format - module-name globs mapped to ``"colwise"``/``"rowwise"`` - is Hugging Face transformers'
``tp_plan`` convention, read from the strategy option or from the model's ``tp_plan`` attribute.

A model written for tensor parallelism must not hard-code its widths after a column-parallel layer:
attention infers its local number of heads from the width it receives (see examples/char_gpt).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Mapping, Optional

from torch import nn

from multigpu.errors import ConfigError

STYLES = ("colwise", "rowwise")


def resolve_plan(model: nn.Module, plan: Optional[Mapping[str, str]]) -> dict[str, str]:
    """``{glob: style}`` -> ``{module name: style}`` for the Linear layers of ``model``, every glob used."""
    plan = plan if plan is not None else getattr(model, "tp_plan", None)
    if not plan:
        raise ConfigError(
            "strategy fsdp+tp needs a tensor-parallel plan: which Linear layers are split.",
            'give strategy_options: {tp_plan: {"*.q": colwise, "*.proj": rowwise, ...}}, or set '
            "model.tp_plan (see examples/char_gpt).",
        )
    if not isinstance(plan, Mapping):
        raise ConfigError(
            f"tp_plan must map module-name globs to colwise/rowwise, not {type(plan).__name__}.",
            'write e.g. {"*.mlp.0": colwise, "*.mlp.2": rowwise}.',
        )
    modules = dict(model.named_modules())
    chosen: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(
                f"tp_plan style {style!r} for {pattern!r} is not one of {', '.join(STYLES)}.",
                "colwise splits a layer's outputs, rowwise its inputs.",
            )
        matched = [name for name in modules if name and fnmatchcase(name, str(pattern))]
        if not matched:
            raise ConfigError(
                f"tp_plan pattern {pattern!r} matches no module of the model.",
                f"module names look like: {', '.join(list(n for n in modules if n)[:6])}.",
            )
        for name in matched:
            if not isinstance(modules[name], nn.Linear):
                raise ConfigError(
                    f"tp_plan pattern {pattern!r} matches {name} ({type(modules[name]).__name__}); "
                    "only Linear layers are split.",
                    "narrow the pattern to the Linear layers.",
                )
            chosen[name] = style
    return chosen


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: Any, plan: Optional[Mapping[str, str]] = None
) -> nn.Module:
    """Split the planned layers of ``model`` across ``tp_mesh`` in place (every tp rank calls this)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    chosen = resolve_plan(model, plan)
    size = tp_mesh.size()
    for name, style in chosen.items():
        layer = dict(model.named_modules())[name]
        width = layer.out_features if style == "colwise" else layer.in_features
        if width % size:
            raise ConfigError(
                f"{name} has {width} {'outputs' if style == 'colwise' else 'inputs'}, which tp={size} "
                "does not divide.",
                f"choose tp dividing {width}, or leave {name} out of the plan.",
            )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {name: styles[style]() for name, style in chosen.items()})
    return model
