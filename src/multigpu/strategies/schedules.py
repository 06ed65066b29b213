"""The pipeline's step: micro-batches through ``torch.distributed.pipelining`` schedules, the loss on the
last stage, and the model object a pipelined run holds (:class:`PipelineParts`).

Why the loss is the user's own ``compute_loss``: the schedule calls a loss function with the last
stage's output for each micro-batch. Here that function slices the micro-batch out of the batch and
calls ``loss_of(micro_batch)`` - the Trainer's ``compute_loss`` - in which ``self.model(inputs)`` returns
the pipeline's output for exactly those inputs (checked). So a recipe switches to pp with one setting.

Exactness: a micro-batch of n rows out of a batch of N contributes ``loss * n / N`` (and the gradient
is not rescaled by the schedule), which is the batch's mean. Every batch runs as ``micro_batches``
equal micro-batches - torch fixes the shapes a stage sends and receives on its first step, and FSDP
needs the same forwards on every data-parallel rank of a stage (each new shape costs a warm-up forward)
- so every batch is padded to the loader's batch size rounded up to a multiple of ``micro_batches``,
with copies of its last row whose outputs are cut off before the loss sees them: a short last batch,
or an evaluation shard one sample shorter than another rank's, adds nothing and runs the same shapes.
Each (padded rows, train/eval) has its own schedule, built on first use: every rank of a pipeline reads
the same batch and builds the same one.

Data parallelism within a stage (``pp+ddp``): the stage's gradients are averaged over its data-parallel
ranks after the schedule's step (one all-reduce per dtype), skipped inside ``no_sync`` - torch's
pipelining drives DDP's reducer by hand, which its own metadata warm-up (a forward through DDP with
gradients on) leaves expecting a backward that never comes.
Evaluation sums the metrics of the micro-batches on the last stage and hands them to the pipeline's
other ranks, so every rank reports the same exact numbers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from multigpu.checkpoint.names import clean_state_dict
from multigpu.errors import ConfigError, MultiGPUError

#: The schedules a run may choose, by their torch class.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}
#: Schedules kept per rank (one per padded batch shape: training, a short last batch, evaluation).
KEEP = 6


def first_item(batch: Any) -> Any:
    """The model's input in a batch: its first element (``(inputs, targets)``), or the batch itself."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def take(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``start:stop`` of every part of ``batch`` that has ``rows`` rows (tensors, lists), the rest as is."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() and batch.shape[0] == rows else batch
    if isinstance(batch, Mapping):
        return {k: take(v, start, stop, rows) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(take(v, start, stop, rows) for v in batch))
    if isinstance(batch, (tuple, list)):
        if len(batch) == rows and not any(isinstance(v, torch.Tensor) for v in batch):
            return batch[start:stop]  # one entry per row (e.g. strings)
        return type(batch)(take(v, start, stop, rows) for v in batch)
    return batch


def check_micro_batches(name: str, micro_batches: int, pp: int) -> None:
    """What torch's schedules require of the number of micro-batches, as one line with a HINT."""
    if name == "1f1b" and micro_batches < pp:
        raise ConfigError(
            f"pipeline_schedule 1f1b needs at least one micro-batch per stage: micro_batches="
            f"{micro_batches}, pp={pp}.",
            f"set micro_batches: {pp} or more (or use gpipe).",
        )
    if name == "interleaved_1f1b" and micro_batches % max(1, micro_batches // pp):
        raise ConfigError(
            f"interleaved_1f1b runs micro-batches in rounds of pp={pp}: micro_batches={micro_batches} "
            "does not split into equal rounds.",
            f"use a multiple of {pp} (or fewer than {pp}).",
        )


def schedule_class(name: str, several_stages: bool) -> type:
    """The torch schedule called ``name`` (gpipe looped over the stages of a rank when it holds several)."""
    from torch.distributed.pipelining import schedules

    if name == "gpipe":
        return schedules.ScheduleLoopedBFS if several_stages else schedules.ScheduleGPipe
    chosen: type = getattr(schedules, SCHEDULES[name])
    return chosen


class StageRunner:
    """This rank's stages and the schedules that run them (kept per batch shape)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        indexes: Sequence[int],
        stages: int,
        device: torch.device,
        group: Any,
        schedule: str,
        micro_batches: int,
        *,
        order: Sequence[str],
        stage_size: int,
        rank: int,
        average_over: Any = None,
    ) -> None:
        self.modules, self.indexes, self.stages = list(modules), list(indexes), stages
        self.device, self.group, self.schedule, self.micro_batches = (
            device,
            group,
            schedule,
            micro_batches,
        )
        self.pp = dist.get_world_size(group)
        self.has_first, self.has_last = 0 in self.indexes, stages - 1 in self.indexes
        self.order, self.stage_size, self.rank = list(order), stage_size, rank
        self._schedules: dict[tuple[Any, ...], Any] = {}
        #: The stage's data-parallel group whose gradients are averaged after each step (pp+ddp), and
        #: whether to (False inside no_sync: accumulation).
        self.average_over, self.sync = average_over, True
        #: The loss function of the step in progress (the schedules are built with a fixed one).
        self._loss: Optional[Callable[[Any, Any], torch.Tensor]] = None

    def schedule_for(self, rows: int, training: bool) -> Any:
        """The schedule for batches of ``rows`` (padded) rows: the chosen one to train, gpipe to evaluate."""
        key = (rows, training)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            if len(self._schedules) >= KEEP:
                self._schedules.pop(next(iter(self._schedules)))
            stages = [
                PipelineStage(module, index, self.stages, self.device, group=self.group)
                for module, index in zip(self.modules, self.indexes, strict=True)
            ]
            several = len(stages) > 1
            cls = schedule_class(self.schedule if training else "gpipe", several)
            self._schedules[key] = cls(
                stages if several else stages[0],
                self.micro_batches,
                loss_fn=self._call_loss,
                scale_grads=False,
            )
        return self._schedules[key]

    def _call_loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._loss is not None
        return self._loss(output, target)

    def run(
        self,
        inputs: torch.Tensor,
        loss: Callable[[Any, int, int], torch.Tensor],
        training: bool,
        pad_to: int = 0,
    ) -> None:
        """One pass of a batch of ``inputs`` (the first stage's) through the schedule, padded to ``pad_to``
        rows (the loader's batch size: the same on every rank) in equal micro-batches; on the last stage
        ``loss(output, start, stop)`` per micro-batch with real rows, the output cut to them."""
        rows = inputs.shape[0]
        padded = -(-max(rows, pad_to) // self.micro_batches) * self.micro_batches
        if padded > rows and self.has_first:
            inputs = torch.cat([inputs, inputs[-1:].expand(padded - rows, *inputs.shape[1:])])
        schedule = self.schedule_for(padded, training)
        # row numbers, split like the inputs
        target = torch.arange(padded) if self.has_last else None
        args = (inputs,) if self.has_first else ()

        def cut(output: Any, index: torch.Tensor) -> torch.Tensor:
            start, stop = int(index[0]), int(index[-1]) + 1
            # all padding: nothing to learn from, but a graph to run backward through
            if start >= rows:
                return (
                    torch.stack([t.sum() for t in _tensors(output)]).sum() * 0.0
                    if training
                    else torch.zeros(())
                )
            return loss(
                output if stop <= rows else _rows(output, rows - start), start, min(stop, rows)
            )

        self._loss = cut
        try:
            if training:
                schedule.step(*args, target=target, return_outputs=False)
            else:
                schedule.eval(*args, target=target)
        finally:
            self._loss = None
        if not training:
            self._reshard()
        elif self.average_over is not None and self.sync:
            self._average_gradients()

    def _average_gradients(self) -> None:
        """The mean of the stage's gradients over its data-parallel ranks (replicas of the stage)."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        size = dist.get_world_size(self.average_over)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for module in self.modules:
            for p in module.parameters():
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.average_over)
            flat /= size
            for grad, value in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(value)

    def _reshard(self) -> None:
        """After a forward without backward FSDP2 keeps a root's parameters gathered: shard them again, so
        that state dicts and the optimizer see the sharded parameters."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.modules:
            for sub in module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()


class PipelineParts(nn.Module):
    """This rank's part of a pipelined model: its stages' layers under the unsplit model's names (what
    checkpoints, the optimizer and clipping see), and ``train_step``/``evaluate_step``, which run the
    schedule. Calling it is only meaningful inside the loss that ``train_step`` is given: there it
    returns the pipeline's output for the micro-batch's inputs."""

    def __init__(self, layers: Mapping[str, nn.Module], runner: StageRunner) -> None:
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)
        self.runner = runner
        self._answer: Optional[list[Any]] = None
        counts = torch.tensor(
            [
                sum(p.numel() for p in self.parameters()),
                sum(p.numel() for p in self.parameters() if p.requires_grad),
            ],
            device=runner.device,
        )
        dist.all_reduce(counts, group=runner.group)  # one rank per stage: every stage once
        #: (parameters, trainable) of the whole model, for the report before the first step.
        self.whole_model_parameters = (int(counts[0]), int(counts[1]))

    def forward(self, inputs: Any) -> Any:
        if self._answer is None:
            raise MultiGPUError(
                "with pp the model runs as a pipeline across processes: calling it outside the loss "
                "of a step has no output here.",
                "call self.model(...) only inside compute_loss or "
                "evaluate_batch; for a loop of your own use model.train_step(batch, loss_of).",
            )
        output, expected, calls = self._answer
        if calls or not _same_inputs(inputs, expected):
            raise ConfigError(
                "with pp, compute_loss (or evaluate_batch) must call self.model once, on the batch's "
                "inputs: the first stage received model_inputs(batch).",
                "override model_inputs(batch) in your Trainer to return what you pass to self.model.",
            )
        self._answer[2] = 1
        return output

    @contextlib.contextmanager
    def _answering(self, output: Any, expected: Any) -> Iterator[None]:
        self._answer = [output, expected, 0]
        try:
            yield
        finally:
            called, self._answer = self._answer[2], None
        if not called:
            raise ConfigError(
                "with pp, compute_loss (or evaluate_batch) must compute its result from "
                "self.model(inputs).",
                "call self.model on the batch's inputs in it.",
            )

    def train(self, mode: bool = True) -> "PipelineParts":
        super().train(mode)
        for module in self.runner.modules:  # the DDP/FSDP wrappers too
            module.train(mode)
        return self

    # ------------------------------------------------------------------ steps
    def train_step(
        self,
        batch: Any,
        loss_of: Callable[[Any], torch.Tensor],
        inputs_of: Callable[[Any], Any] = first_item,
        *,
        divide: int = 1,
        scale: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        pad_to: int = 0,
    ) -> torch.Tensor:
        """Forward and backward of ``batch`` through the pipeline; returns the batch's mean loss (float64)
        on every rank of the pipeline. ``loss_of(micro_batch)``: its mean loss, computed from
        ``self(inputs_of(micro_batch))``; ``divide`` (accumulation) and ``scale`` (fp16) as for backward;
        ``pad_to``: the loader's batch size (shorter batches are padded to it, see the module's notes)."""
        inputs = self._inputs(batch, inputs_of)
        rows = inputs.shape[0]
        losses: dict[int, torch.Tensor] = {}

        def loss(output: Any, start: int, stop: int) -> torch.Tensor:
            micro = take(batch, start, stop, rows)
            with self._answering(output, inputs_of(micro)):
                value = loss_of(micro)
            weighted = value * ((stop - start) / rows)
            losses[start] = weighted.detach()  # the warm-up's call for micro-batch 0 is overwritten
            backward = weighted / divide if divide > 1 else weighted
            return scale(backward) if scale is not None else backward

        self.runner.run(inputs, loss, training=True, pad_to=pad_to)
        total = torch.zeros((), dtype=torch.float64, device=self.runner.device)
        for value in losses.values():
            total += value.to(total.device, torch.float64)
        # from the last stage to every stage (the others add 0)
        dist.all_reduce(total, group=self.runner.group)
        return total

    def evaluate_step(
        self,
        batch: Any,
        metrics_of: Callable[[Any], Mapping[str, tuple[Any, Any]]],
        inputs_of: Callable[[Any], Any] = first_item,
        pad_to: int = 0,
    ) -> dict[str, tuple[Any, Any]]:
        """Forward only: ``metrics_of(micro_batch)`` (sums and counts) added up over the micro-batches - on
        the last stage; the other stages return {} (see :meth:`shared`)."""
        inputs = self._inputs(batch, inputs_of)
        rows = inputs.shape[0]
        sums: dict[str, tuple[Any, Any]] = {}

        def metrics(output: Any, start: int, stop: int) -> torch.Tensor:
            micro = take(batch, start, stop, rows)
            with self._answering(output, inputs_of(micro)):
                values = metrics_of(micro)
            for name, (total, count) in values.items():
                old = sums.get(name, (0, 0))
                sums[name] = (old[0] + total, old[1] + count)
            return torch.zeros(())

        self.runner.run(inputs, metrics, training=False, pad_to=pad_to)
        return sums if self.runner.has_last else {}

    def shared(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's metrics on every rank of the pipeline (the others computed none)."""
        box: list[Any] = [metrics if self.runner.has_last else None]
        dist.broadcast_object_list(box, group_src=self.runner.pp - 1, group=self.runner.group)
        shared: dict[str, float] = box[0]
        return shared

    def _inputs(self, batch: Any, inputs_of: Callable[[Any], Any]) -> torch.Tensor:
        inputs = inputs_of(batch)
        if not isinstance(inputs, torch.Tensor) or inputs.dim() == 0 or inputs.shape[0] == 0:
            raise ConfigError(
                f"with pp the first stage takes one tensor of rows; model_inputs(batch) gave "
                f"{type(inputs).__name__}{'' if not isinstance(inputs, torch.Tensor) else ' without rows'}.",
                "override model_inputs(batch) in your Trainer to return the model's input tensor.",
            )
        return inputs

    # ------------------------------------------------------------------ the whole model's weights
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's full weights with plain names on global rank 0 (empty elsewhere): a collective."""
        local = {
            name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu()
            for name, value in self.state_dict().items()
        }
        runner = self.runner
        mine = local if runner.rank % runner.stage_size == 0 else {}  # one rank per stage sends
        gathered: Optional[list[Any]] = [None] * dist.get_world_size() if runner.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:
            return {}
        merged = {name: value for part in gathered for name, value in part.items()}
        position = {name: index for index, name in enumerate(runner.order)}
        return clean_state_dict(
            dict(sorted(merged.items(), key=lambda item: position[item[0].split(".")[0]]))
        )


def _tensors(output: Any) -> list[torch.Tensor]:
    return (
        [output]
        if isinstance(output, torch.Tensor)
        else [t for t in output if isinstance(t, torch.Tensor)]
    )


def _rows(output: Any, count: int) -> Any:
    """The first ``count`` rows of a stage's output (a tensor, or a tuple of them)."""
    if isinstance(output, torch.Tensor):
        return output[:count]
    return type(output)(t[:count] if isinstance(t, torch.Tensor) else t for t in output)


def _same_inputs(given: Any, expected: Any) -> bool:
    if given is expected:
        return True
    return (
        isinstance(given, torch.Tensor)
        and isinstance(expected, torch.Tensor)
        and given.shape == expected.shape
        and given.device == expected.device
        and bool(torch.equal(given, expected))
    )
