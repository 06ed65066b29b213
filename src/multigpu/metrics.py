"""Metrics across ranks: sums and counts reduced once, and per-sample results gathered in order.

Why sums and counts: the mean of per-rank means is wrong when shards differ in size (101 samples on
2 ranks); the sum of sums over the sum of counts is exact. Reducing once per evaluation, not once per
step, keeps collectives out of the training step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from multigpu.distributed.session import group_active

Number = Union[int, float, torch.Tensor]


class MetricSums:
    """Accumulate ``(sum, count)`` per metric name on this rank; ``compute()`` reduces across ranks.

    ``group``: the ranks holding different data (None: every rank). Under tensor parallelism the ranks
    of one tp group see the same batch; reducing over the data-parallel group counts it once.
    """

    def __init__(
        self,
        device: Union[str, torch.device] = "cpu",
        group: Any = None,
        before_reduce: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.device = torch.device(device)
        self.group = group
        self._before_reduce = before_reduce
        self._sums: dict[str, torch.Tensor] = defaultdict(
            lambda: torch.zeros(2, dtype=torch.float64, device=self.device)
        )

    def add(self, name: str, total: Number, count: Number = 1) -> None:
        """Add a *sum* over ``count`` samples (e.g. number correct, or loss x batch size)."""
        acc = self._sums[name]
        acc[0] += (
            total.detach().to(acc.device, torch.float64)
            if isinstance(total, torch.Tensor)
            else float(total)
        )
        acc[1] += (
            count.detach().to(acc.device, torch.float64)
            if isinstance(count, torch.Tensor)
            else float(count)
        )

    def update(self, values: Mapping[str, tuple[Number, Number]]) -> None:
        for name, (total, count) in values.items():
            self.add(name, total, count)

    def compute(self) -> dict[str, float]:
        """Global means: one all_reduce for every metric together (every rank must call this)."""
        if not self._sums:
            return {}
        names = sorted(self._sums)
        stacked = torch.stack([self._sums[n] for n in names])
        if group_active():
            if self._before_reduce is not None:
                self._before_reduce("reducing metrics")
            dist.all_reduce(stacked, group=self.group)
        return {
            n: s / c if c > 0 else float("nan")
            for n, (s, c) in zip(names, stacked.tolist(), strict=True)
        }


def reduce_sums(
    values: Mapping[str, tuple[Number, Number]], device: Union[str, torch.device] = "cpu"
) -> dict[str, float]:
    """One-shot :class:`MetricSums`: ``{"acc": (correct, n)}`` on each rank -> the global ratio."""
    sums = MetricSums(device)
    sums.update(values)
    return sums.compute()


def gather_in_order(local: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Per-sample results of an evaluation loader, reassembled in dataset order on every rank.

    Rank r of W evaluated samples r, r+W, r+2W, ... (:class:`multigpu.data.samplers.EvalSampler`), so the
    full result interleaves the shards. Shards may differ in length by one.
    """
    if not group_active():
        return local
    world = dist.get_world_size(group)
    size = torch.tensor([local.shape[0]], device=local.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    shards = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(shards, padded, group=group)
    total = int(sum(s.item() for s in sizes))
    out = torch.empty((total, *local.shape[1:]), dtype=local.dtype, device=local.device)
    for r, (shard, n) in enumerate(zip(shards, sizes, strict=True)):
        out[r::world] = shard[: int(n.item())]
    return out
