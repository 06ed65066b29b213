"""Parameter names as a plain model has them, whatever wrapped it: checkpoints that load anywhere.

Why in ``checkpoint``: a checkpoint written from a DDP- or torch.compile-wrapped model carries
``module.`` and ``_orig_mod.`` in its keys and then fails to load into the plain model a user builds
to evaluate or deploy. The strategies use the same names when they rebuild an optimizer on sharded
parameters.
"""

from __future__ import annotations

from typing import Any


def clean_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """Keys as a plain model names them, so checkpoints load into an unwrapped model on any device.

    Call it on the state of the *unwrapped* module: what is left to remove is ``_orig_mod`` from
    submodules compiled with torch.compile. A state saved by other tools with every key under
    ``module.`` (a DDP/DP wrapper) loses that prefix too.
    """
    clean = {strip_name(key): value for key, value in state.items()}
    if clean and all(key.startswith("module.") for key in clean):
        clean = {key[len("module.") :]: value for key, value in clean.items()}
    return clean


def strip_name(name: str) -> str:
    """Drop the ``_orig_mod`` components torch.compile adds (a name no user module uses)."""
    return ".".join(p for p in name.split(".") if p != "_orig_mod")
