"""``multigpu check SCRIPT --nproc N --steps K``: does *your* script compute on N processes what it computes on one?

It runs the script twice through ``multigpu run``, unchanged: on N processes with its own batch size
b per process, and on one process whose loaders (``run.loader``, the Trainer's) give N x b samples per
step. Both runs stop after K optimizer steps (see :mod:`multigpu.guards.probe`, which records
them). Then it compares the loss of every step and every weight, prints a table, and names every
cause the records support - from what was measured, not from guesses:

- what each step trained on: forward passes (micro-steps) per optimizer step and samples per forward
  on every rank, so a world-size-dependent accumulation or batch, an unscaled loader, drop_last or
  padding are told apart; and the global batch of each run, side by side;
- identical inputs on different data-parallel ranks (the data is not sharded), whatever made them;
- ranks that stepped the optimizer a different number of times; gradients never averaged
  (``no_sync`` on every micro-step, or on the last one; a forward around the DDP wrapper; parameters
  outside the model given to ``run.setup``); replicas whose weights drifted apart;
- BatchNorm without SyncBatchNorm; a loss summed over the batch or gradients summed over ranks;
  every rank drawing the same random numbers; parameters that get no gradient;
- mistakes that are wrong on any number of processes: gradients clipped before the GradScaler
  unscaled them, an LR scheduler stepped per micro-step, a metric averaged over the ranks' means.

Verdicts: EQUAL (exit 0) only when the numbers agree, the sample counts agree, every rank's inputs
were seen and differ, and no cause was found; DIFFERENT (exit 1); "EQUAL numbers, but" (exit 1) for
mistakes that are wrong on one process too; UNVERIFIED (exit 3) when the numbers agree but what the
runs trained on could not be seen; exit 2 when the script did not run or never stepped an optimizer.

Dropout is switched off in both runs (it cannot draw the same masks for one batch of N x b as for N
batches of b); everything else is the script's own.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

from multigpu import validate
from multigpu.diagnostics.causes import BLOCKING, WRONG, diagnose, unverified
from multigpu.diagnostics.outcome import (
    Outcome,
    batch_shape,
    finite_or_inf,
    tolerance_for,
    weight_differences,
)
from multigpu.distributed.job import JOB_VAR, Check, job_env
from multigpu.errors import LaunchError
from multigpu.fileio import Folder
from multigpu.launch.flags import RunFlags
from multigpu.launch.process import StopSignals, launched, stopping_cleanly

#: Exit statuses of ``multigpu check``.
EQUAL, DIFFERENT, DID_NOT_RUN, UNVERIFIED = 0, 1, 2, 3


def _run(
    command: Sequence[str],
    nproc: int,
    scale: int,
    steps: int,
    folder: Path,
    cpu: bool,
    timeout_s: float,
    stops: StopSignals,
    procs_per_gpu: int = 1,
) -> Outcome:
    Folder(folder.parent).make(folder.name)
    env = {**os.environ, **job_env(os.environ.get(JOB_VAR), check=Check(str(folder), steps, scale))}
    argv = RunFlags(nproc=nproc, procs_per_gpu=procs_per_gpu, tee_prefix="never", cpu=cpu).to_argv(
        command
    )
    with launched(
        argv, stops, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        stops.release()  # (see launched)
        try:
            output, errors = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stops.holding = True  # (see launched)
            raise LaunchError(
                f"the {nproc}-process run did not finish in {timeout_s:.0f} s.",
                "lower --steps, or give --timeout more seconds.",
            ) from None
    return Outcome.read(folder, proc.returncode, output + errors)


def check(
    command: Sequence[str],
    nproc: int,
    steps: int,
    cpu: bool = False,
    tolerance: Optional[float] = None,
    keep: bool = False,
    timeout_s: float = 600.0,
    out: Callable[[str], None] = print,
    procs_per_gpu: int = 1,
    show_output: bool = False,
) -> int:
    """Run, compare, print the verdict; the exit status (:data:`EQUAL` 0 ... :data:`UNVERIFIED` 3).

    ``procs_per_gpu``: the N processes share the GPUs K to a GPU (a one-GPU machine checks 2 processes
    with ``nproc=2, procs_per_gpu=2``); the one-process run has a GPU to itself. ``show_output``: print
    each run's own output (stdout and stderr) before the comparison."""
    validate.count(
        nproc,
        "--nproc",
        LaunchError,
        low=2,
        high=validate.MAX_PROCS_PER_NODE,
        hint="compare 2 or more processes against one.",
    )
    validate.count(steps, "--steps", LaunchError, low=1, high=10_000)
    if procs_per_gpu != 1:  # refuse an impossible device plan now, not as a failed run
        from multigpu.launch.devices import plan_devices, visible_gpus

        plan_devices(visible_gpus(), nproc=nproc, procs_per_gpu=procs_per_gpu, cpu=cpu)
    # a stop signal raises: the runs are stopped, the folders removed
    with stopping_cleanly() as stops:
        return _check(
            command,
            nproc,
            steps,
            cpu,
            tolerance,
            keep,
            timeout_s,
            out,
            procs_per_gpu,
            show_output,
            stops,
        )


def _check(
    command: Sequence[str],
    nproc: int,
    steps: int,
    cpu: bool,
    tolerance: Optional[float],
    keep: bool,
    timeout_s: float,
    out: Callable[[str], None],
    procs_per_gpu: int,
    show_output: bool,
    stops: StopSignals,
) -> int:
    root: Optional[Path] = None
    try:
        with stops.held():  # the folder and our hold on it come together
            root = Path(tempfile.mkdtemp(prefix="multigpu-check-"))
        out(
            f"multigpu check: {' '.join(command)}: {nproc} processes (their own batch each) against 1 process "
            f"(the {nproc}x batch), {steps} optimizer step(s); dropout off in both"
        )
        many = _run(
            command, nproc, 1, steps, root / f"n{nproc}", cpu, timeout_s, stops, procs_per_gpu
        )
        one = _run(command, 1, nproc, steps, root / "n1", cpu, timeout_s, stops)
        if show_output:
            for outcome, label in ((many, f"{nproc}-process"), (one, "1-process")):
                out(f"\n----- the script's output, {label} run (exit {outcome.status}) -----")
                out(outcome.output.rstrip() or "(no output)")
            out("----- end of the script's output -----")
        return report(many, one, nproc, steps, tolerance, out)
    finally:
        stops.holding = True  # a stop now waits for the clean-up
        if root is not None and keep:
            out(f"records kept in {root}")
        elif root is not None:
            with contextlib.suppress(OSError):
                Folder(root.parent).remove_tree(root.name)


def report(
    many: Outcome,
    one: Outcome,
    nproc: int,
    steps: int,
    tolerance: Optional[float],
    out: Callable[[str], None] = print,
) -> int:
    """Print the comparison of two runs' records and the verdict; return the exit status."""
    for outcome, label in ((many, f"{nproc}-process"), (one, "1-process")):
        if outcome.most_steps == 0 and not outcome.ranks and outcome.status == 0:
            out(
                f"the {label} run finished (exit 0) without calling mg.init(): check records what mg.init() and "
                "run.setup (or mg.Trainer) see, so a script that sets up its own DDP - the PyTorch DDP tutorial's "
                "shape, Hugging Face's Trainer, Accelerate - cannot be compared."
            )
            out(
                "HINT: such a script runs unchanged under `multigpu run`; to check it, build the model with "
                "run.setup and step through run.loader (docs/migrating.md), or compare its losses yourself."
            )
            return DID_NOT_RUN
        if outcome.most_steps == 0:
            why = (
                outcome.error_line()
                if outcome.status != 0
                else "it ran, but no optimizer step went through run.setup's model"
            )
            out(f"the {label} run recorded no step (exit {outcome.status}): {why}")
            out(
                "HINT: the script must build its model with run.setup (or the Trainer) and step an optimizer; "
                "run it with `multigpu run` first."
            )
            return DID_NOT_RUN
    for outcome, label in ((many, f"{nproc}-process"), (one, "1-process")):
        if outcome.stranded:
            out(
                f"the {label} run: rank(s) {', '.join(map(str, outcome.stranded))} went past step {steps} without "
                f"stepping; the ranks that reached it left without them, so their next collective failed "
                f"(exit {outcome.status}): {outcome.error_line()}"
            )
        elif outcome.status != 0 or outcome.steps < steps:
            out(
                f"the {label} run stopped after {outcome.steps} of {steps} step(s) (exit {outcome.status}): "
                f"{outcome.error_line()}"
            )
    causes = diagnose(many, one, nproc)
    dtype = (
        next((r[0].get("dtype") for r in one.ranks if r and r[0].get("dtype")), None) or "float32"
    )
    tol = tolerance_for(dtype, steps, tolerance)
    out(f"\nglobal batch of step 1:  {batch_shape(many)}   |   {batch_shape(one)}")
    shown = min(many.steps, one.steps)  # steps every rank of both runs recorded
    if shown:
        out(
            f"\n{'step':>4}  {'loss, ' + str(nproc) + ' procs':>15}  {'loss, 1 proc':>15}  {'rel. diff':>9}  samples"
        )
    else:
        out("\n(no step was recorded by every rank of both runs: nothing to compare step by step)")
    worst_loss = 0.0 if shown else math.inf
    for i in range(shown):
        a, b = many.loss(i), one.loss(i)
        if a is None and b is None:
            rel = 0.0  # neither run reported a loss (see the note below): the weights decide
        elif a is None or b is None:
            rel = math.inf
        else:
            rel = finite_or_inf(abs(a - b) / max(abs(b), 1e-12))
        worst_loss = max(worst_loss, rel)
        out(
            f"{i + 1:>4}  {a if a is not None else float('nan'):>15.8g}  {b if b is not None else float('nan'):>15.8g}  "
            f"{rel:>9.2e}  {many.samples(i)} / {one.samples(i)}"
        )
    if shown and all(many.loss(i) is None and one.loss(i) is None for i in range(shown)):
        out("(no losses: nothing was backpropagated through a scalar loss; the weights decide)")
    weights_many, weights_one = many.weights(), one.weights()
    # stays so when a run stopped before writing its weights ("a run stopped early")
    worst_weight = math.inf
    if weights_many is not None and weights_one is not None:
        rows = weight_differences(weights_many, weights_one)
        worst = max(rows, key=lambda row: row[2]) if rows else ("-", 0.0, 0.0)
        worst_weight = worst[2]
        out(
            f"\nweights after step {steps}: {len(rows)} tensor(s); largest difference {worst[1]:.3g} in {worst[0]} "
            f"({worst[2]:.3g} of its largest value)"
        )
    diverged = [
        i + 1
        for i in range(shown)
        if all(v is not None and not math.isfinite(v) for v in (many.loss(i), one.loss(i)))
    ]
    if diverged:  # NaN against NaN says nothing either way
        out(
            f"verdict: UNVERIFIED - the loss is NaN or infinite in both runs from step {diverged[0]}: nothing to "
            "compare (the training diverged, or the model or the data hold NaN or inf). Check the loss on one "
            "process first, or run fewer --steps."
        )
        return UNVERIFIED
    same_samples = all(many.samples(i) == one.samples(i) for i in range(shown))
    complete = many.status == 0 and one.status == 0 and many.steps >= steps and one.steps >= steps
    numbers_agree = complete and worst_loss <= tol and worst_weight <= tol and same_samples
    blocking = [c for c in causes if c.kind == BLOCKING]
    wrong = [c for c in causes if c.kind == WRONG]
    within = f"within {tol:.2g}, {dtype}"
    if not numbers_agree or blocking:
        if numbers_agree:
            out(
                f"verdict: DIFFERENT - the numbers agree ({within}), but {nproc} processes do not train as one "
                "process does:"
            )
        else:
            parts = []
            if worst_loss > tol and shown:
                parts.append(
                    f"losses differ by up to {worst_loss:.3g}"
                    if math.isfinite(worst_loss)
                    else "a loss is NaN or infinite in one run only"
                )
            if weights_many is not None and weights_one is not None and worst_weight > tol:
                parts.append(f"weights differ by up to {worst_weight:.3g}")
            if not same_samples:
                parts.append("the runs trained on different sample counts")
            if not complete:
                parts.append("a run stopped early")
            out(f"verdict: DIFFERENT - {'; '.join(parts)} (tolerance {tol:.2g}, {dtype})")
        if causes:
            out("why:")
            for cause in causes:
                out(f"  - {cause.text}")
        else:
            out(
                "why: none of the usual causes was seen (sharding, batch size, accumulation, BatchNorm, summed losses, "
                "gradient sync, shared random streams, unused parameters, averaged metrics). Run again with --keep "
                "and compare the records."
            )
        return DIFFERENT
    reasons = unverified(many, one, nproc)
    if wrong:
        out(
            f"verdict: EQUAL numbers ({within}), but the records show a mistake that is wrong on any number of "
            "processes:"
        )
        for text in [c.text for c in causes] + reasons:
            out(f"  - {text}")
        return DIFFERENT
    if reasons:
        out(f"verdict: UNVERIFIED - the numbers agree ({within}), but that proves nothing here:")
        for text in reasons + [c.text for c in causes]:
            out(f"  - {text}")
        return UNVERIFIED
    # numeric explanations only arise with a difference; kept so that nothing found goes unsaid
    if causes:
        out(f"verdict: EQUAL ({within}), but:")
        for cause in causes:
            out(f"  - {cause.text}")
        return EQUAL
    out(f"verdict: EQUAL - {nproc} processes compute what 1 process computes ({within})")
    return EQUAL
