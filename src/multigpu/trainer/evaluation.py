"""Exact evaluation across ranks: every sample counted once, and sharded models' forwards kept paired.

Why its own module: evaluation on N processes must give the single-process number, and it must not
hang. Replicated models are evaluated without their DDP wrapper (whose forward may broadcast buffers,
a collective the ranks would not all join); each rank sums its metrics over its own, unpadded shard
and the sums are reduced once. A sharded model (FSDP, tensor parallel) is different: every forward is
a collective (all-gathers), so a rank with fewer batches repeats one whose results are dropped until
the rank with most is done - counted up front for a dataset, agreed batch by batch for a stream.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from multigpu.data import LoaderLike
from multigpu.distributed import agreement
from multigpu.errors import ConfigError
from multigpu.trainer.batches import move_to

Metrics = Mapping[str, tuple[Any, Any]]


def evaluate_shard(
    loader: LoaderLike,
    evaluate_batch: Callable[[Any], Metrics],
    *,
    run: Any,
    device: torch.device,
    autocast: Callable[[], Any],
    sharded_model: bool,
    heartbeat: Callable[[], None],
) -> dict[str, float]:
    """Global metrics over this rank's share of ``loader``; ``heartbeat`` after each batch (the watchdog)."""
    sums = run.metric_sums()
    group, active = run.control_group, run.session.active
    last: Optional[Any] = None
    empty = ConfigError(
        "a sharded model needs every rank to evaluate at least one batch.",
        "use an evaluation set with at least as many samples as processes.",
    )

    def repeat_forward() -> None:
        if last is None:
            raise empty
        with autocast():
            evaluate_batch(last)

    extra = 0
    if sharded_model and loader.length is not None:
        most = agreement.most(loader.length, group, active)
        if loader.length == 0 and most > 0:
            raise empty
        extra = most - loader.length
    batches = iter(loader)
    while True:
        batch = next(batches, None)
        if (
            sharded_model
            and loader.length is None
            and not agreement.any_rank(batch is not None, group, active)
        ):
            break
        if batch is None:
            if not sharded_model or loader.length is not None:
                break
            repeat_forward()  # a stream ended here first: keep the others' forwards paired
            continue
        last = move_to(batch, device)
        with autocast():
            sums.update(evaluate_batch(last))
        heartbeat()
    for _ in range(extra):  # keep FSDP's all-gathers paired across ranks; results dropped
        repeat_forward()
    results: dict[str, float] = sums.compute()
    return results
