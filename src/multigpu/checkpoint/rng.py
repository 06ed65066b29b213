"""Random-number-generator states as plain tensors, so they load with ``weights_only=True``.

Why: exact resume needs python's, numpy's and torch's (CPU and every CUDA device's) generators back
where they were; numpy's own state object is not a safe type for ``torch.load``.
"""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any, Optional

import torch

np: Optional[ModuleType]
try:  # numpy is optional for the package; it is there whenever torch's numpy bridge is.
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


def capture() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"].cpu())
    if np is not None and "numpy" in state:
        npst = state["numpy"]
        np.random.set_state(
            (
                npst["kind"],
                npst["keys"].numpy().astype("uint32"),
                npst["pos"],
                npst["has_gauss"],
                npst["cached"],
            )
        )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])


def seed_everything(seed: int) -> None:
    """The same seed for python, numpy and torch (every device)."""
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
