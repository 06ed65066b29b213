"""Stop on SIGTERM / SIGUSR1 at a step every rank agrees on, so one checkpoint captures the run.

Why agreement: the signal may reach the ranks at different steps (or only some of them); a rank that
stops to checkpoint while another trains on would hang both. Each step boundary starts a tiny
asynchronous all-reduce (MAX) of this rank's "stop requested" flag on the CPU control group and
reads the previous one, which finished in the background during the step: every rank sees the same
value at the same step, with no host synchronisation in the training step. The run stops one step
after the signal, saves, and exits with :data:`EXIT_PREEMPTED` (75, sysexits' EX_TEMPFAIL: "try
again later"), which ``multigpu queue`` and Slurm requeue read as "resume me".
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

#: Exit status of a run that stopped cleanly on a preemption signal after writing its checkpoint.
EXIT_PREEMPTED = 75
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written; exits the script with EXIT_PREEMPTED."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopSignal:
    """Signal handlers plus the cross-rank agreement. ``poll()`` at each step boundary."""

    def __init__(self, group: Any = None, active: bool = False, signals: Sequence[int] = DEFAULT_SIGNALS) -> None:
        self.group = group  # None: the default group (gloo); a gloo subgroup under nccl
        self.distributed = active
        self.signals = tuple(signals)
        self.received: Optional[int] = None
        self._previous: dict[int, Any] = {}
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._work: Any = None

    # -------------------------------------------------------------- handlers
    def install(self) -> "StopSignal":
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("multigpu: fit() is not on the main thread; preemption signals are not handled.",
                          stacklevel=3)
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = signum

    def uninstall(self) -> None:
        self.finish()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop as if ``signum`` had arrived (tests, or a user's own condition)."""
        self.received = signum

    # -------------------------------------------------------------- agreement
    def poll(self) -> bool:
        """True on every rank at the same step once any rank has received a stop signal."""
        if not self.distributed:
            return self.received is not None
        agreed = False
        if self._work is not None:
            self._work.wait()
            agreed = bool(self._flag.item())
            self._work = None
        if agreed:
            return True
        self._flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return False

    def finish(self) -> None:
        """Complete the outstanding all-reduce (every rank calls this at the same point)."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def describe(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a stop request from another rank"


def requeue_slurm_job(job_id: str, signum: int) -> bool:
    """``scontrol requeue`` this job after a USR1 (Slurm's "time is nearly up" warning).

    Not on SIGTERM: that is also what ``scancel`` sends, and a cancelled job must stay cancelled.
    """
    if not job_id or signum != signal.SIGUSR1 or shutil.which("scontrol") is None:
        return False
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"multigpu: could not requeue Slurm job {job_id}: {exc}", file=sys.stderr, flush=True)
        return False
    if done.returncode != 0:
        print(f"multigpu: scontrol requeue {job_id} failed: {done.stderr.strip()} "
              "(HINT: submit with --requeue, which `multigpu slurm` does)", file=sys.stderr, flush=True)
    return done.returncode == 0
