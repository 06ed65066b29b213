"""The training loop's safety as one object: hang watchdog, preemption agreement, interrupt handling.

Why one object: a Trainer and a hand-written loop need the same four things - a heartbeat per step
(:mod:`~multigpu.guards.watchdog`), a stop every rank agrees on (:mod:`~multigpu.guards.preemption`),
knowing that this rank left the lockstep (Ctrl-C or an exception, :mod:`~multigpu.guards.interrupt`)
so no collective waits for partners that are not coming, and the desync guard before training
(:mod:`~multigpu.guards.consistency`). The :class:`~multigpu.runtime.Run` owns one ``Guards`` and
delegates to it in one line per method.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from multigpu.distributed.agreement import any_rank
from multigpu.distributed.session import DistSession
from multigpu.errors import ConfigError, MultiGPUError
from multigpu.guards.preemption import Preempted, StopSignal, requeue_slurm_job
from multigpu.guards.trial import TrialChannel
from multigpu.guards.watchdog import HangWatchdog


@dataclass(frozen=True)
class GuardSettings:
    """How the guards behave; ``run.configure_guards(**settings)`` changes them before the first step."""

    hang_timeout_s: Optional[float] = 900.0
    #: One line naming where every rank is after this long without a step (None: none; the watchdog's
    #: report and the exit still come at hang_timeout_s).
    hang_notice_s: Optional[float] = 60.0
    report_dir: str = "outputs/hang"
    preemption: bool = True
    #: Agree on stopping every K optimizer steps (None: about every 2 s, adapted to the step time).
    stop_check_every: Optional[int] = None


class Guards:
    """One Run's safety, over the Run's process group (``session``)."""

    def __init__(self, session: DistSession, trial_dir: Optional[str] = None) -> None:
        self.session = session
        self.trial_dir = trial_dir  # a queue trial's channel to its search (Job.trial_dir)
        self.settings = GuardSettings()
        #: Why this rank left the lockstep (None: it has not).
        self.interrupted_by: Optional[str] = None
        self._stop: Optional[StopSignal] = None
        self._watchdog: Optional[HangWatchdog] = None
        self._trial: Optional[TrialChannel] = None

    def configure(self, **settings: Any) -> GuardSettings:
        known = [f.name for f in fields(GuardSettings)]
        for key in settings:
            if key not in known:
                raise ConfigError(f"unknown guard setting {key!r}.", f"known: {', '.join(known)}.")
        self.settings = replace(self.settings, **settings)
        return self.settings

    # ------------------------------------------------------------------ per step
    def step_done(self, step: int) -> None:
        """The watchdog's heartbeat; the first call starts the watchdog."""
        watchdog = self._watchdog
        if watchdog is None:
            if not self.settings.hang_timeout_s:
                return
            watchdog = self._watchdog = HangWatchdog(
                self.settings.hang_timeout_s,
                Path(self.settings.report_dir),
                self.session.world.rank,
                self.session.world.world_size,
                notice_s=self.settings.hang_notice_s,
            ).start()
        watchdog.beat(step)

    def should_stop(self) -> bool:
        """True on every rank at the same step once any rank got SIGTERM/SIGUSR1; the first call installs
        the signal handlers."""
        if self._stop is None:
            if not self.settings.preemption:
                return False
            self._stop = StopSignal(
                self.session.control, self.session.active, every=self.settings.stop_check_every
            ).install()
        if self.interrupted_by:
            return False
        return self._stop.poll()

    def exit_preempted(
        self, say: Callable[[str], None], checkpoint_path: Any = None, step: Optional[int] = None
    ) -> None:
        """After the agreed stop and its checkpoint: requeue the Slurm job on SIGUSR1, raise Preempted (75)."""
        stop = self._stop
        reason = stop.describe() if stop is not None else "a stop request"
        where = (
            f"; checkpoint {checkpoint_path} - run the same command again to resume"
            if checkpoint_path
            else ""
        )
        after = f" after step {step}" if step is not None else ""
        say(f"multigpu: stopped by {reason}{after}{where}")
        # One requeue per job: global rank 0 (with replica groups, the first group's), after every line this
        # rank has to say - the requeue ends the job's processes, this one among them.
        if self.session.world.global_rank == 0 and stop is not None and stop.received is not None:
            requeue_slurm_job(self.session.world.slurm_job_id, stop.received)
        raise Preempted(
            f"preempted by {reason}"
            + (f"; resume from {checkpoint_path}" if checkpoint_path else "")
        )

    def report(self, value: Any, step: int, say: Callable[[str], None]) -> bool:
        """A queue trial's report to its search (see :mod:`~multigpu.guards.trial`); True on every rank
        once the search pruned the trial. Nothing at all outside a queue trial."""
        if self._trial is None:
            world, session = self.session.world, self.session
            self._trial = TrialChannel(
                self.trial_dir,
                world.is_main,
                say=say,
                agree=lambda flag: any_rank(flag, session.control, session.active),
                stopping=lambda: self._stop is not None and self._stop.received is not None,
            )
        if self._trial.folder is None:
            return False
        self.ensure_usable("run.report")
        self.settle()  # no stop agreement in flight on the control group while this one runs
        with self.paused():  # rank 0 may wait for the queue's answer
            return self._trial.report(value, step)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No hang report while inside (a long checkpoint write, an evaluation hook)."""
        with self._watchdog.paused() if self._watchdog is not None else contextlib.nullcontext():
            yield

    def settle(self) -> None:
        """Wait for the outstanding stop agreement (every rank started it, so it completes at once): a
        DataLoader worker forked while gloo's thread is inside an all-reduce can inherit its locks and hang."""
        if self._stop is not None and not self.interrupted_by:
            self._stop.finish()

    def release(self, clean: bool = True) -> None:
        """Stop the watchdog and restore the signal handlers; ``clean=False`` (leaving by an exception)
        abandons the outstanding agreement instead of waiting for ranks that may not come."""
        if self._stop is not None:
            self._stop.uninstall(wait=clean and not self.interrupted_by)
        if self._watchdog is not None:
            self._watchdog.stop()
        self._stop = self._watchdog = None

    # ------------------------------------------------------------------ leaving the lockstep
    def interrupt(self, reason: str) -> None:
        """Mark this rank as having left the lockstep (Ctrl-C, an exception out of ``fit``)."""
        self.interrupted_by = self.interrupted_by or reason

    def ensure_usable(self, doing: str = "a collective") -> None:
        """Refuse a collective at once after an interrupt: the other ranks may be anywhere."""
        if self.interrupted_by and self.session.active:
            raise MultiGPUError(
                f"{doing} needs every rank, but this rank was interrupted ({self.interrupted_by}) "
                "and the others may be anywhere.",
                "let the script end after an interrupt; run it again to resume from the last "
                "checkpoint.",
            )


__all__ = ["GuardSettings", "Guards", "Preempted"]
