"""Batches as the loop sees them: moved to the device, and counted.

Plain functions over nested tuples, lists, dicts and namedtuples of tensors, shared by the Trainer and
anyone's own loop.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch


def move_to(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Tensors inside tuples, lists and dicts, moved to ``device`` (by default non-blocking: from pinned
    memory the copy overlaps the previous step)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: move_to(v, device, non_blocking) for k, v in batch.items()}
        # most mappings' classes take a dict (Mapping's own signature does not)
        rebuild: Any = type(batch)
        try:
            return rebuild(moved)
        # a defaultdict (its first argument is a factory) or another unusual mapping
        except TypeError:
            return moved
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(move_to(v, device, non_blocking) for v in batch)
    if hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to(v, device, non_blocking) for v in batch))
    return batch


def batch_length(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if type(batch) in (tuple, list) and batch and type(batch[0]) is torch.Tensor and batch[0].dim():
        # the common (inputs, labels) batch, without the general walk below
        return batch[0].shape[0]
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = (
        batch.values()
        if isinstance(batch, Mapping)
        else batch
        if isinstance(batch, (list, tuple))
        else []
    )
    for value in values:
        n = batch_length(value)
        if n:
            return n
    return 0
