"""One batch's forward and backward, and evaluation's forward, as the loop takes them.

Why an object: with ``pp`` > 1 the pipeline schedule runs forward and backward together, micro-batch by
micro-batch, on processes that each hold some of the layers (``torch.distributed.pipelining``) - so
"compute the loss, then backward" is one of two ways to take a step. The loop asks this object for
either (torchtitan's train loop calls ``pp_schedule.step`` in place of the forward and backward in the
same way). Everything around it - accumulation, clipping, the optimizer, logging, checkpoints - stays
the loop's, unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from multigpu.strategies.schedules import PipelineParts
from multigpu.trainer.evaluation import evaluate_shard


class ForwardBackward:
    """The plain step: autocast forward and ``compute_loss``, then the strategy's (scaled) backward."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def train(self, batch: Any, batch_size: int) -> torch.Tensor:
        """Forward and backward of one batch (inside no_sync when it is not an accumulation boundary);
        ``batch_size``: the loader's (a pipeline pads shorter batches to it)."""
        t, accumulate = self.trainer, self.trainer.settings.accumulate
        with t.precision.autocast():
            loss: torch.Tensor = t.compute_loss(batch)
        t.strategy.backward(t.precision.scale(loss / accumulate if accumulate > 1 else loss))
        return loss

    def evaluate(self, loader: Any, sharded_model: bool) -> dict[str, float]:
        """Exact global metrics of ``evaluate_batch`` over ``loader`` (:mod:`multigpu.trainer.evaluation`)."""
        t = self.trainer
        metrics = evaluate_shard(
            loader,
            self.evaluator(t.evaluate_batch, loader.batch_size),
            run=t.run,
            device=t.device,
            autocast=t.precision.autocast,
            sharded_model=sharded_model,
            heartbeat=lambda: t.run.step_done(t.state.global_step),
        )
        return self.shared(metrics)

    def evaluator(
        self, evaluate_batch: Callable[[Any], Mapping[str, Any]], batch_size: int
    ) -> Callable[[Any], Mapping[str, Any]]:
        """What evaluation calls per batch (of at most ``batch_size``)."""
        return evaluate_batch

    def shared(self, metrics: dict[str, float]) -> dict[str, float]:
        """The evaluation's metrics on every rank (they already are)."""
        return metrics


class PipelineStep(ForwardBackward):
    """pp > 1: the schedule's step; ``compute_loss`` runs on the last stage per micro-batch, with
    ``self.model(inputs)`` answering the pipeline's output; the loss reaches every stage's ranks."""

    def train(self, batch: Any, batch_size: int) -> torch.Tensor:
        t = self.trainer
        # around the schedule: it runs each micro-batch's backward right after
        with t.precision.autocast():
            loss: torch.Tensor = t.state_model.train_step(
                batch,
                t.compute_loss,
                t.model_inputs,
                divide=t.settings.accumulate,
                scale=t.precision.scale,
                pad_to=batch_size,
            )
        return loss

    def evaluator(
        self, evaluate_batch: Callable[[Any], Mapping[str, Any]], batch_size: int
    ) -> Callable[[Any], Mapping[str, Any]]:
        parts, inputs_of = self.trainer.state_model, self.trainer.model_inputs
        return lambda batch: parts.evaluate_step(
            batch, evaluate_batch, inputs_of, pad_to=batch_size
        )

    def shared(self, metrics: dict[str, float]) -> dict[str, float]:
        shared: dict[str, float] = self.trainer.state_model.shared(metrics)
        return shared


def make_step(trainer: Any) -> ForwardBackward:
    """The pipeline's step when the strategy split the model into stages across processes, else the plain one."""
    return (
        PipelineStep(trainer)
        if isinstance(trainer.state_model, PipelineParts)
        else ForwardBackward(trainer)
    )
