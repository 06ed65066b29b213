"""What a training step may add besides the loop's own moves - profiling, weight averaging, the step
guard - built from the settings, each None when off.

Why one small object: the loop stays readable against a hand-written DDP loop (a handful of lines call
in here), and a feature that is off costs the loop one ``is None`` test per optimizer step, nothing else.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional

import torch

from multigpu.trainer.averaging import WeightAverage
from multigpu.trainer.options import PROFILE_DEFAULTS
from multigpu.trainer.profiling import StepProfiler, snapshot_on_oom
from multigpu.trainer.step_guard import StepGuard


class StepExtras:
    def __init__(self, settings: Any, run: Any, model: torch.nn.Module, out_dir: Any) -> None:
        """``model``: the strategy's model without wrappers (FSDP's own module, DDP's inner one)."""
        s = settings
        self.run = run
        self.out_dir = out_dir
        self.memory_snapshot = s.memory_snapshot_on_oom
        profile = s.profile or (dict(PROFILE_DEFAULTS) if run.job.profile else None)  # None: off
        self.profiler: Optional[StepProfiler] = (
            StepProfiler(profile, out_dir, run.rank, run.is_main, run.device, run.print)
            if profile
            else None
        )
        self.averaging: Optional[WeightAverage] = None
        if s.ema is not None or s.swa_start is not None:
            self.averaging = WeightAverage(
                model, decay=s.ema, start=s.swa_start, keep_full=run.is_main
            )
        self.guard: Optional[StepGuard] = None
        if s.skip_nonfinite or s.skip_grad_norm_above is not None or s.skip_loss_above is not None:
            self.guard = StepGuard(
                loss_above=s.skip_loss_above,
                grad_norm_above=s.skip_grad_norm_above,
                max_in_a_row=s.max_skipped_in_a_row,
                group=run.control_group,
                active=run.session.active,
                say=run.print,
            )

    @property
    def after_each_step(self) -> bool:
        """Whether :meth:`after_step` has anything to do (the loop skips the call otherwise)."""
        return self.profiler is not None or self.averaging is not None

    @contextlib.contextmanager
    def fitting(self, steps_done: int = 0) -> Iterator[None]:
        """Around the epochs of ``fit`` (``steps_done`` before it): the profiler and the out-of-memory snapshot."""
        with contextlib.ExitStack() as stack:
            if self.memory_snapshot:
                stack.enter_context(
                    snapshot_on_oom(self.out_dir, self.run.rank, self.run.device, self.run.print)
                )
            if self.profiler is not None:
                self.profiler.start(steps_done)
                stack.callback(self.profiler.stop)
            yield

    def after_step(self, stepped: bool, step: int) -> None:
        """After optimizer step ``step`` (``stepped``: False when the guard skipped it)."""
        if stepped and self.averaging is not None:
            self.averaging.update(step)
        if self.profiler is not None:
            self.profiler.step()

    def averaged(self) -> Any:
        """The model on its averaged weights inside (when averaging is on and has begun)."""
        return self.averaging.swapped() if self.averaging is not None else contextlib.nullcontext()

    def row(self) -> dict[str, Any]:
        """What a step row adds."""
        return {"skipped_steps": self.guard.skipped} if self.guard is not None else {}

    def report(self) -> list[str]:
        """Rank 0's start lines for what is on."""
        lines = []
        if self.profiler is not None:
            p = self.profiler.settings
            first = p["wait"] + p["warmup"] + 1
            cycles = f", {p['repeat']} cycles" if p["repeat"] > 1 else ""
            lines.append(
                f"multigpu: profile: tracing steps {first}-{first + p['active'] - 1} of this fit{cycles} "
                f"into {self.profiler.folder.path}"
            )
        if self.averaging is not None:
            lines.append(
                f"multigpu: weight averaging: {self.averaging.describe()}; validation uses the averaged "
                "weights; checkpoints hold them as averaged_model"
            )
        if self.guard is not None:
            g = self.guard
            bounds = "".join(
                [
                    f", loss above {g.loss_above:g}" if g.loss_above is not None else "",
                    f", gradient norm above {g.grad_norm_above:g}"
                    if g.grad_norm_above is not None
                    else "",
                ]
            )
            lines.append(
                f"multigpu: step guard: steps with a loss or gradient norm not finite{bounds} are skipped on "
                f"every rank (the run stops after {g.max_in_a_row} in a row)"
            )
        return lines

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Entries of the checkpoint (a collective under fsdp: every rank calls it)."""
        state: dict[str, Any] = {}
        if self.averaging is not None:
            state.update(self.averaging.state_dict())
        if self.guard is not None:
            state["step_guard"] = self.guard.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.averaging is not None and not self.averaging.load_state_dict(state):
            self.run.print(
                "multigpu: the checkpoint holds no averaged weights: averaging starts now"
            )
        if self.guard is not None:
            self.guard.load_state_dict(state.get("step_guard"))
