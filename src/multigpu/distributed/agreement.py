"""Every "does any rank ...?" in one place: reductions of a few integers over the CPU control group.

Why one module: a rank that decides alone (its stream ended, it got SIGTERM, it has fewer evaluation
batches) and acts on it leaves the others waiting in a collective it will never join - the classic
silent DDP hang. Each such decision is a tiny all-reduce of a few integers on the gloo control group,
taken by every rank at the same point. The loop needs two forms:

- synchronous (:func:`any_rank`, :func:`most`): once per evaluation pass, where a wait does not matter;
- asynchronous (:class:`Pending`): started at one step and read at the next, so it completes while the
  step computes and no step waits on it (a stream's end, the preemption check points).

With one process (``group_active`` False) every function answers from this rank alone, so callers
never branch on the world size.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

#: The reductions a flag agreement needs: MAX ("any rank"), MIN ("every rank").
_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce_ints(
    values: Sequence[int], op: str, group: Any = None, active: bool = True
) -> list[int]:
    """``values`` reduced element-wise over the ranks of ``group`` (``op``: "max" or "min")."""
    if not active:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor.tolist()


def any_rank(flag: bool, group: Any = None, active: bool = True) -> bool:
    """True on every rank if ``flag`` is true on at least one."""
    return bool(reduce_ints([int(flag)], "max", group, active)[0])


def most(value: int, group: Any = None, active: bool = True) -> int:
    """The largest ``value`` over the ranks, on every rank."""
    return reduce_ints([value], "max", group, active)[0]


class Pending:
    """One asynchronous reduction of a few integers: ``start(values)`` now, ``result()`` later.

    Every rank starts and reads it at the same points. ``before`` runs before each start (the Run
    refuses a collective after an interrupt there). ``abandon()`` is for leaving by an exception: never
    wait on a collective the other ranks may not join.
    """

    def __init__(
        self,
        op: str,
        group: Any = None,
        active: bool = True,
        before: Optional[Callable[[], None]] = None,
    ) -> None:
        self.op = _OPS[op]
        self.group = group
        self.active = active
        self.before = before
        #: Collectives started (the overhead test counts them).
        self.started = 0
        self._tensor: Optional[torch.Tensor] = None
        self._work: Any = None

    @property
    def in_flight(self) -> bool:
        return self._work is not None

    def start(self, values: Sequence[int]) -> None:
        if self.before is not None:
            self.before()
        self._tensor = torch.tensor(list(values), dtype=torch.int64)
        if self.active:
            self._work = dist.all_reduce(self._tensor, op=self.op, group=self.group, async_op=True)
            self.started += 1

    def result(self) -> list[int]:
        """The reduced values (waits for them); every rank reads them after ``start``."""
        self.finish()
        if self._tensor is None:
            raise RuntimeError("Pending.result() before start(): nothing was reduced")
        return self._tensor.tolist()

    def finish(self) -> None:
        """Complete the reduction in flight, if any (every rank calls this at the same point)."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def abandon(self) -> None:
        self._work = None
