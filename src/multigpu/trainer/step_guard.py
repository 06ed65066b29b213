"""The step guard: skip an optimizer step whose loss or gradient norm is NaN/inf (or above a bound) - on
every rank, so no rank's weights diverge from the others'.

Why a decision of all ranks: the loss is each rank's own, so a NaN on one rank alone would make that
rank skip while the others step (under fsdp each rank would then hold shards of different models). The
ranks agree through :mod:`multigpu.distributed.agreement` (the CPU control group's tiny all-reduce),
the same door as every other "does any rank ...?" of the loop. The gradient norm is already global
(the strategy's clip: DDP's averaged gradients, FSDP's norm over every shard).

What it costs, and only when it is on: deciding needs the flags on the host before the optimizer step,
so a guarded step has one host synchronisation (the step's loss and gradient norm read back, two numbers)
and one all-reduce of four integers over gloo - measured in docs/observability.md. The fp16 gradient scaler pays the same read
for its inf check. Off (the default), the loop calls nothing.

A skipped step is counted (``skipped_steps`` in the step rows, a line on rank 0) and leaves no trace in
the weights, the optimizer state, the scheduler or the averaged weights; its batches are left out of the
loss means. ``max_skipped_in_a_row`` skipped steps in a row stop the run with one line: it diverged.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from multigpu.distributed import agreement
from multigpu.errors import MultiGPUError

#: Why a step was skipped, in the order of the flags.
REASONS = (
    "loss not finite",
    "loss above skip_loss_above",
    "gradient norm not finite",
    "gradient norm above skip_grad_norm_above",
)
#: Lines printed for the first skips; after them, one line per this many.
SHOW_FIRST, SHOW_EVERY = 10, 100


class StepGuard:
    def __init__(
        self,
        *,
        loss_above: Optional[float] = None,
        grad_norm_above: Optional[float] = None,
        max_in_a_row: int = 20,
        group: Any = None,
        active: bool = True,
        say: Callable[[str], None] = print,
    ) -> None:
        self.loss_above = loss_above
        self.grad_norm_above = grad_norm_above
        self.max_in_a_row = max_in_a_row
        self.group = group
        self.active = active
        self.say = say
        #: Steps skipped in this run (restored on resume), and in a row now.
        self.skipped = 0
        self.in_a_row = 0
        #: The loop's loss sum this epoch, and its value after the last step taken (read on the host anyway).
        self._sum: Optional[torch.Tensor] = None
        self._mark = 0.0

    def reasons(self, step_loss: float, micro_batches: int, grad_norm: float) -> list[int]:
        """This rank's four reasons (0/1), in the order of :data:`REASONS`."""
        mean = step_loss / micro_batches
        finite_loss, finite_norm = math.isfinite(mean), math.isfinite(grad_norm)
        return [
            int(not finite_loss),
            int(finite_loss and self.loss_above is not None and mean > self.loss_above),
            int(not finite_norm),
            int(
                finite_norm
                and self.grad_norm_above is not None
                and grad_norm > self.grad_norm_above
            ),
        ]

    def check(
        self, loss_sum: torch.Tensor, micro_batches: int, grad_norm: torch.Tensor, state: Any
    ) -> int:
        """At an accumulation boundary, before the optimizer step (``state.global_step`` steps done): 0 to
        step, or - on every rank alike - the number of this step's batches, to skip it. ``loss_sum``: the
        loop's running sum of batch losses; on a skip it is put back to where it was before this step's
        batches, so the loss means leave them out."""
        # the one read
        total, norm = torch.stack([loss_sum.detach(), grad_norm.detach().to(loss_sum)]).tolist()
        before = self._mark if self._sum is loss_sum else 0.0  # a new sum: a new epoch
        reasons = agreement.reduce_ints(
            self.reasons(total - before, micro_batches, norm), "max", self.group, self.active
        )
        self._sum = loss_sum
        if not any(reasons):
            self.in_a_row = 0
            self._mark = total
            return 0
        loss_sum.fill_(before)  # the very value read before: the sum as it was
        self.skipped += 1
        self.in_a_row += 1
        step = state.global_step + 1
        why = ", ".join(r for r, flag in zip(REASONS, reasons) if flag)
        if self.skipped <= SHOW_FIRST or self.skipped % SHOW_EVERY == 0:
            self.say(
                f"multigpu: skipped step {step}: {why} on at least one rank ({self.skipped} skipped so far)"
            )
        if self.in_a_row >= self.max_in_a_row:
            raise MultiGPUError(
                f"training diverged: {self.in_a_row} optimizer steps in a row were skipped "
                f"(last at step {step}: {why}).",
                "lower the learning rate or clip gradients (clip_grad_norm), resume from an earlier "
                "checkpoint, or raise max_skipped_in_a_row.",
            )
        return micro_batches

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: Any) -> None:
        if isinstance(state, dict):
            for key in ("skipped", "in_a_row"):
                value = state.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    setattr(self, key, value)
