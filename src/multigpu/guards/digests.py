"""Short fingerprints of what a rank saw: the tensors of a batch, its weights, its random streams.

Why a module of its own: ``multigpu check`` compares ranks by these digests (identical inputs on every
rank, one random stream for all) without moving the tensors themselves; walking a nested batch and
hashing a bounded slice of each tensor is the same job for all of them.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch

#: Elements of a tensor that go into its digest (enough to tell batches or replicas apart).
DIGEST_LIMIT = 1 << 20


def tensors_in(value: Any, found: list[Any], depth: int = 0) -> list[Any]:
    """Every tensor in a (nested) batch: tensors, mappings, sequences, dataclass-like objects."""
    if depth > 6 or len(found) > 64:
        return found
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            tensors_in(item, found, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            tensors_in(item, found, depth + 1)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            tensors_in(getattr(value, name, None), found, depth + 1)
    return found


def first_tensor(value: Any) -> Optional[torch.Tensor]:
    found = tensors_in(value, [])
    return found[0] if found else None


def tensor_digest(tensors: list[Any]) -> str:
    """One digest of the bytes of every tensor given (each cut at :data:`DIGEST_LIMIT` elements)."""
    h = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)[:DIGEST_LIMIT].cpu().contiguous()
        h.update(str(tuple(tensor.shape)).encode())
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()[:16]


def rng_digest(device: Optional[torch.device]) -> str:
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    if device is not None and device.type == "cuda":
        # dropout on a GPU draws from its generator
        h.update(torch.cuda.get_rng_state(device).numpy().tobytes())
    return h.hexdigest()[:16]
