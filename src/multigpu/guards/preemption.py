"""Stop on SIGTERM / SIGUSR1 at a step every rank agrees on, so one checkpoint captures the run.

Why agreement: the signal may reach the ranks at different steps (or only some of them); a rank that
stops to checkpoint while another trains on would hang both. So the ranks agree at check points: a
tiny asynchronous all-reduce (MAX) of [this rank's "stop requested" flag, its proposed interval] on
the CPU control group is started at one check point and read at the next - it finishes in the
background meanwhile, so no step waits on it and nothing synchronises with the GPU. Every rank reads
the same value at the same step, stops there, one checkpoint is written, and the run exits with
:data:`EXIT_PREEMPTED` (75, sysexits' EX_TEMPFAIL: "try again later"), which ``multigpu queue`` and
Slurm requeue read as "resume me".

Why not every step: that is a second collective per step competing with the gradients' (measured in
benchmarks/peers.py). The check points are spaced about ``target_s`` seconds apart (between 1 and
1,000 steps): each rank proposes an interval from its own step time and the agreed one is the
smallest, so every rank spaces the next check points identically without any other message. A stop
therefore takes at most two intervals (~4 s) - far inside Slurm's 90 s warning. ``every=K`` fixes the
interval instead (K=1: the old every-step agreement).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any, Optional, Sequence

from typing_extensions import override

from multigpu.distributed.agreement import Pending
from multigpu.errors import EXIT_PREEMPTED, shown, visible

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written; exits the script with EXIT_PREEMPTED."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.message = message

    @override
    def __str__(self) -> str:
        return self.message


class StopSignal:
    """Signal handlers plus the cross-rank agreement. ``poll()`` once per optimizer step on every rank."""

    def __init__(
        self,
        group: Any = None,
        active: bool = False,
        signals: Sequence[int] = DEFAULT_SIGNALS,
        every: Optional[int] = None,
        target_s: float = 2.0,
        max_every: int = 1000,
    ) -> None:
        self.group = group  # None: the default group (gloo); a gloo subgroup under nccl
        self.distributed = active
        self.signals = tuple(signals)
        self.received: Optional[int] = None
        self.every = every
        self.target_s = target_s
        self.max_every = max_every
        self._previous: dict[int, Any] = {}
        #: [any rank asked to stop, -(the smallest interval proposed)]: a MAX agreement of both.
        self._agreement = Pending("max", group, active)
        self._calls = 0
        self._next_check = 1
        self._last_check: Optional[tuple[int, float]] = None

    # -------------------------------------------------------------- handlers
    def install(self) -> "StopSignal":
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "multigpu: fit() is not on the main thread; preemption signals are not handled.",
                stacklevel=3,
            )
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = signum

    def uninstall(self, wait: bool = True) -> None:
        """Restore the handlers. ``wait=False`` (leaving by an exception) abandons the outstanding
        agreement instead of waiting for it: the other ranks may never join it."""
        if wait:
            self.finish()
        self._agreement.abandon()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    # -------------------------------------------------------------- agreement
    def poll(self) -> bool:
        """True on every rank at the same step once any rank has received a stop signal."""
        if not self.distributed:
            return self.received is not None
        self._calls += 1
        if self._calls < self._next_check:
            return False
        stop, interval = False, self.every or 1
        if self._agreement.in_flight:
            flag, negative_interval = self._agreement.result()
            stop, interval = bool(flag), self.every or -negative_interval
        if stop:
            return True
        self._agreement.start([int(self.received is not None), -self._propose()])
        self._next_check = self._calls + max(1, interval)
        return False

    @property
    def collectives(self) -> int:
        """Collectives this agreement has started (the overhead test counts them)."""
        return self._agreement.started

    def _propose(self) -> int:
        """This rank's wish for the interval after the next one: ``target_s`` worth of its own steps."""
        if self.every:
            return self.every
        now = time.monotonic()
        last, self._last_check = self._last_check, (self._calls, now)
        if last is None or now <= last[1]:
            return 1
        per_step = (now - last[1]) / max(1, self._calls - last[0])
        return int(min(self.max_every, max(1, self.target_s / per_step)))

    def finish(self) -> None:
        """Complete the outstanding all-reduce (every rank calls this at the same point)."""
        self._agreement.finish()

    def describe(self) -> str:
        return (
            signal.Signals(self.received).name
            if self.received is not None
            else "a stop request from another rank"
        )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal past SIGRTMIN has no name of its own
        return f"signal {number}"


def requeue_slurm_job(job_id: str, signum: int) -> bool:
    """``scontrol requeue`` this job after a USR1 (Slurm's "time is nearly up" warning).

    Not on SIGTERM: that is also what ``scancel`` sends, and a cancelled job must stay cancelled.

    The requeue ends every process of the job at once: slurmstepd sends each step SIGCONT and SIGTERM, and
    the batch script's ``srun`` answers its SIGTERM by killing its step (this rank, its log copier, and
    ``scontrol`` itself) - so the line that says so is written before the request, and ``scontrol`` runs with
    SIGTERM ignored (a disposition ``exec`` keeps): on a busy node it died of that SIGTERM before it read the
    controller's answer, and a requeue that had gone through was reported as failed (once in the suite's
    stability runs). A ``scontrol`` killed all the same says so in one line.
    """
    if not job_id or signum != signal.SIGUSR1 or shutil.which("scontrol") is None:
        return False
    # Slurm sets a number; anything else was set by hand
    if not re.fullmatch(r"[0-9]{1,12}", job_id):
        print(
            f"multigpu: SLURM_JOB_ID={shown(job_id, 40)} is not a Slurm job number, so the job was not "
            "requeued (HINT: unset SLURM_JOB_ID outside Slurm jobs)",
            file=sys.stderr,
            flush=True,
        )
        return False
    # On stdout, as the stop's own line: it goes to the job's log file itself, not through a log copier
    print(
        f"multigpu: requeueing Slurm job {job_id} (this ends the job's processes now)", flush=True
    )
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", 'trap "" TERM; exec scontrol requeue "$1"', "scontrol", job_id],
            capture_output=True,
            encoding="utf-8",
            errors="replace",
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(
            f"multigpu: could not requeue Slurm job {job_id}: {visible(str(exc))[:300]}",
            file=sys.stderr,
            flush=True,
        )
        return False
    if done.returncode < 0:  # killed with the job's processes before the answer came, or by hand
        print(
            f"multigpu: scontrol requeue {job_id} was ended by {_signal_name(-done.returncode)} before "
            f"it answered (HINT: `scontrol show job {job_id}` shows whether the job was requeued)",
            file=sys.stderr,
            flush=True,
        )
    elif done.returncode != 0:
        print(
            f"multigpu: scontrol requeue {job_id} failed: {visible(' '.join(done.stderr.split()))[:300]} "
            "(HINT: submit with --requeue, which `multigpu slurm` does)",
            file=sys.stderr,
            flush=True,
        )
    return done.returncode == 0
