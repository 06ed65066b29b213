"""Place runs on a pool of GPUs (or CPU slots): each run gets its own devices, its own rendezvous port
(every ``multigpu run`` picks a free one), its own folder with its resolved config, log and status.

``--runs-per-gpu K`` (or ``gpus: 0.5`` in the runs file) packs small runs onto one GPU: each is held
to its share of the GPU's memory (the job's ``memory_fraction``, applied by ``mg.init``), so a run
that does not fit fails alone, with a message that names its share, instead of starving its neighbours.

A failing run frees its devices and the others go on; the queue reports it at the end with the tail
of its log. Running the queue again skips finished runs (same config) and restarts interrupted or
failed ones, which resume from their own checkpoints. On Ctrl-C or SIGTERM the running runs get
SIGTERM - the Trainer checkpoints and stops - and are marked interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import IO, Any, Callable, Optional, Sequence

from multigpu import validate
from multigpu.distributed.job import job_env
from multigpu.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, ConfigError
from multigpu.fileio import Folder, atomic_write_text, open_append
from multigpu.launch import environment
from multigpu.launch.local import usable_cores
from multigpu.launch.process import LAUNCH_STOP_WAIT_S, own_session_dying_with_parent
from multigpu.queue.lock import RunLock
from multigpu.queue.run_folder import (
    LOG_FILE,
    STATUS_FILE,
    decide,
    finished_as,
    move_aside,
    write_run_config,
)
from multigpu.queue.runs import MAX_RUNS_PER_GPU, QueueEntry


@dataclass
class EntryState:
    spec: QueueEntry
    folder: Path
    state: str = "queued"  # queued, running, done, failed, interrupted, skipped
    slots: list[str] = field(default_factory=list)
    started: Optional[float] = None
    ended: Optional[float] = None
    exit_code: Optional[int] = None
    proc: Optional[subprocess.Popen[Any]] = None
    log: Optional[IO[str]] = None
    note: str = ""
    #: Its whole GPUs/slots, or its share of one (below 1).
    share: Fraction = Fraction(1)
    #: Held while the run runs (one queue at a time per run folder).
    lock: RunLock = field(init=False)

    def __post_init__(self) -> None:
        self.lock = RunLock(self.folder.parent, self.spec.name)

    @property
    def elapsed(self) -> Optional[float]:
        if self.started is None:
            return None
        return (self.ended or time.time()) - self.started

    def save_status(self) -> None:
        status = {
            "state": self.state,
            "exit_code": self.exit_code,
            "started": self.started,
            "ended": self.ended,
            "slots": self.slots,
            "share": str(self.share),
            "fingerprint": self.spec.fingerprint(),
        }
        atomic_write_text(self.folder / STATUS_FILE, json.dumps(status, indent=1))


class Queue:
    def __init__(
        self,
        specs: Sequence[QueueEntry],
        root: Path,
        slots: Sequence[str],
        on_gpus: bool,
        max_parallel: Optional[int] = None,
        display: Optional[Callable[["Queue", str], None]] = None,
        poll_s: float = 0.1,
        runs_per_gpu: int = 1,
        searches: Sequence[Any] = (),
    ) -> None:
        self.root = Path(root)
        self.slots = list(slots)
        self.on_gpus = on_gpus
        #: None: as many as fit (each slot holds one whole run, or shares adding up to one).
        self.max_parallel = max_parallel
        validate.count(runs_per_gpu, "--runs-per-gpu", ConfigError, high=MAX_RUNS_PER_GPU)
        self.display = display or (lambda queue, event: None)
        self.poll_s = poll_s
        self.runs = [
            EntryState(spec, self.root / spec.name, share=spec.share(runs_per_gpu))
            for spec in specs
        ]
        self._stop = threading.Event()
        self._stop_signal: Optional[int] = None
        self.runs_per_gpu = runs_per_gpu
        #: Searches (queue.search.Search) whose trials are asked while the queue runs, when the pool has room.
        self.searches = list(searches)
        for run in [
            *self.runs,
            *(EntryState(s.entry, self.root / s.entry.name) for s in self.searches),
        ]:
            if run.spec.gpus > len(self.slots):
                unit = "GPU(s)" if on_gpus else "slot(s)"
                raise ConfigError(
                    f"run {run.spec.name!r} needs {run.spec.gpus} {unit} but the pool has {len(self.slots)}.",
                    "give the queue more --gpus (or --slots), or lower the run's gpus: setting.",
                )

    # ------------------------------------------------------------------ main loop
    def execute(self) -> int:
        """Run everything to the end; returns 0 if every run succeeded (or was already done)."""
        Folder(self.root).create()
        try:
            # its earlier trials: skipped when finished, resumed when not
            for search in self.searches:
                self.runs += [
                    EntryState(spec, self.root / spec.name, share=spec.share(self.runs_per_gpu))
                    for spec in search.start()
                ]
            self._skip_finished()
            for search in self.searches:
                search.settle_earlier(self.runs)
        except BaseException:
            self._close_searches()
            raise
        for run in self.runs:
            if run.state == "skipped":
                self.display(self, f"skipped {run.spec.name}")
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        self.started = time.time()
        try:
            while True:
                self._reap()
                # new evaluations of running trials -> the pruner's answers
                for search in self.searches:
                    search.poll(self.runs)
                if self._stop.is_set():
                    self._stop_all()
                    break
                self._launch_ready()
                self._ask_searches()
                if not any(r.state in ("queued", "running") for r in self.runs):
                    break
                self.display(self, "tick")
                time.sleep(self.poll_s)
        except BaseException:
            # the queue itself failed: its runs stop cleanly and are marked interrupted
            self._stop_all()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._close_searches()
            self.ended = time.time()
            self.display(self, "end")  # always: a live table left running hides the cursor
        if self._stop_signal is not None:
            return 128 + self._stop_signal
        return 0 if all(r.state in ("done", "skipped") for r in self.runs) else 1

    def _threads(self, share: Fraction, processes: int, slots: int) -> Optional[str]:
        """The ``OMP_NUM_THREADS`` a run gets from the queue (None: the queue's own, or torch's default).
        Runs sharing cores (CPU slots, or several runs on one GPU) each get their share of them, or they
        thrash each other."""
        if (self.on_gpus and share >= 1) or "OMP_NUM_THREADS" in os.environ:
            return None
        cores = int(max(1, usable_cores() // len(self.slots)) * min(share, Fraction(1)) * slots)
        return str(max(1, cores // processes))

    def _ask_searches(self) -> None:
        """A new trial of each search while the pool has room and nothing else is waiting for it."""
        if self._stop.is_set() or any(r.state == "queued" for r in self.runs):
            return
        running = sum(1 for r in self.runs if r.state == "running")
        for search in self.searches:
            probe = EntryState(
                search.entry,
                self.root / search.entry.name,
                share=search.entry.share(self.runs_per_gpu),
            )
            while search.wants_more() and (
                self.max_parallel is None or running < self.max_parallel
            ):
                slots = self.place(probe)
                if slots is None:
                    break
                spec = search.ask()
                run = EntryState(spec, self.root / spec.name, share=probe.share)
                self.runs.append(run)
                self._start(run, slots)
                running += run.state == "running"

    def _close_searches(self) -> None:
        for search in self.searches:
            search.close()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_signal = signum
        self._stop.set()

    def _skip_finished(self) -> None:
        """Show what each run will do; the decision is taken again, under the run's lock, at its start."""
        for run in self.runs:
            if not run.lock.acquire():
                run.state, run.note = (
                    "skipped",
                    f"running in another queue (pid {run.lock.holder()})",
                )
                continue
            run.lock.release()
            decision = decide(run.folder, run.spec.fingerprint())
            if decision.action == "skip":
                status = decision.status
                run.state, run.exit_code = "skipped", 0
                run.started, run.ended = status.get("started"), status.get("ended")
            run.note = decision.note

    def _load(self) -> dict[str, Fraction]:
        """How much of each slot the running runs take (1: full)."""
        load = {slot: Fraction(0) for slot in self.slots}
        for run in self.runs:
            if run.state == "running":
                for slot in run.slots:
                    load[slot] += min(run.share, Fraction(1))
        return load

    def place(self, run: EntryState, whole_waiting: bool = False) -> Optional[list[str]]:
        """The slots for ``run`` now, or None. Whole runs take empty slots in pool order. A share goes to
        the least-loaded slot it fits on (spread: packed runs slow each other down) - unless a run of
        whole GPUs is queued, then to the fullest it fits on (best fit), keeping GPUs free for it."""
        load = self._load()
        if run.share >= 1:
            free = [slot for slot in self.slots if load[slot] == 0]
            return free[: int(run.share)] if len(free) >= run.share else None
        fits = [slot for slot in self.slots if load[slot] + run.share <= 1]
        if not fits:
            return None
        if whole_waiting:
            return [max(fits, key=lambda slot: load[slot])]
        return [min(fits, key=lambda slot: load[slot])]

    def _waiting(self, run: EntryState, states: dict[str, EntryState]) -> Optional[str]:
        """The run ``run`` still waits for (``after:``, ``{run:NAME}``); None when it may start. A run that
        waited for one that did not finish fails here, unstarted, naming it."""
        for name in run.spec.waits_for():
            other = states.get(name)
            why = "did not finish"
            # not in this queue (--only): its folder says whether it finished, as it is now
            if other is None:
                finished = finished_as(self.root / name, run.spec.upstream.get(name))
                why = "is not done with its settings in this file (run it first)"
            elif other.state in ("queued", "running"):
                return name
            else:
                finished = other.state == "done" or (
                    other.state == "skipped" and other.exit_code == 0
                )
                if other.state == "skipped" and other.exit_code != 0:
                    why = f"runs in another queue ({other.note}); start this one again when it is done"
            if not finished:
                run.state, run.note = "failed", f"not started: {name} {why}"
                # (no status file: the next queue tries it again)
                run.started = run.ended = time.time()
                self.display(self, f"failed {run.spec.name}")
                return name
        return None

    def _launch_ready(self) -> None:
        running = sum(1 for r in self.runs if r.state == "running")
        whole_queued = any(r.state == "queued" and r.share >= 1 for r in self.runs)
        # a run of whole GPUs is waiting: later shares do not start (it would starve)
        blocked = False
        states = {r.spec.name: r for r in self.runs}  # what runs wait for, by name (once per pass)
        for run in self.runs:
            if run.state != "queued" or (
                self.max_parallel is not None and running >= self.max_parallel
            ):
                continue
            if run.spec.waits_for() and self._waiting(run, states) is not None:
                continue
            if blocked and run.share < 1:
                continue
            slots = self.place(run, whole_waiting=whole_queued)
            if slots is None:
                blocked = blocked or run.share >= 1
                continue  # a later, smaller run may still fit
            self._start(run, slots)
            running += 1

    def _start(self, run: EntryState, slots: list[str]) -> None:
        try:
            self._start_process(run, slots)
        # its folder cannot be used (a symbolic link, no space): this run fails alone
        except OSError as exc:
            run.lock.release()
            run.state, run.exit_code, run.note = (
                "failed",
                None,
                f"cannot start: {exc.strerror or exc}: {exc.filename or ''}",
            )
            run.started = run.ended = time.time()
            self.display(self, f"failed {run.spec.name}")

    def _start_process(self, run: EntryState, slots: list[str]) -> None:
        if not run.lock.acquire():
            run.state, run.note = "skipped", f"running in another queue (pid {run.lock.holder()})"
            self.display(self, f"skipped {run.spec.name}")
            return
        decision = decide(run.folder, run.spec.fingerprint())
        if decision.action == "skip":  # another queue finished it since this one started
            run.lock.release()
            run.state, run.exit_code, run.note = "skipped", 0, decision.note
            self.display(self, f"skipped {run.spec.name}")
            return
        if decision.action == "fresh":
            run.note = move_aside(run.folder)
        write_run_config(run.folder, run.spec)
        env, held = environment.run_environment(
            os.environ, {k: str(v) for k, v in run.spec.env.items()}
        )
        if held:
            run.note = (
                f"credentials not passed (its env names an endpoint): {', '.join(held)[:120]}"
            )
        env["MULTIGPU_RUN_NAME"] = run.spec.name
        # The run's job is the queue's own, never inherited: it may write in its folder only, and only a
        # packed run gets a memory share.
        env.update(
            job_env(
                None,
                run_dir=str(run.folder),
                **run.spec.job_changes(run.folder),
                memory_fraction=float(f"{float(run.share):.6g}")
                if self.on_gpus and run.share < 1
                else None,
            )
        )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(slots) if self.on_gpus else ""
        threads = self._threads(run.share, run.spec.processes(self.on_gpus), len(slots))
        if threads:
            env["OMP_NUM_THREADS"] = threads
        command = run.spec.command(run.folder, self.on_gpus)
        run.log = open_append(run.folder / LOG_FILE)
        run.log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
        run.log.flush()
        try:
            run.proc = subprocess.Popen(
                command,
                stdout=run.log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=own_session_dying_with_parent(),
            )
        except OSError as exc:  # a run that cannot start fails alone
            run.log.write(f"multigpu: cannot start the run: {exc}\n")
            run.started = time.time()
            self._finish(run, 127)
            return
        run.state, run.slots, run.started, run.ended, run.exit_code = (
            "running",
            slots,
            time.time(),
            None,
            None,
        )
        run.save_status()
        self.display(self, f"start {run.spec.name}")

    def _reap(self) -> None:
        for run in self.runs:
            if run.state != "running" or run.proc is None:
                continue
            code = run.proc.poll()
            if code is None:
                continue
            self._finish(run, code)

    def _finish(self, run: EntryState, code: int, interrupted: bool = False) -> None:
        run.exit_code, run.ended = code, time.time()
        run.state = (
            "done"
            if code == 0
            else (
                "interrupted"
                if interrupted or code in (EXIT_PREEMPTED, 128 + signal.SIGTERM, EXIT_INTERRUPTED)
                else "failed"
            )
        )
        if run.log is not None:
            run.log.close()
            run.log = None
        run.proc = None
        run.save_status()
        run.lock.release()
        for search in self.searches:  # a trial: tell its study (done or pruned)
            search.finished(run)
        self.display(self, f"{run.state} {run.spec.name}")

    def _stop_all(self) -> None:
        """Graceful: SIGTERM to every running run (its workers checkpoint and stop), then wait."""
        running = [(r, r.proc) for r in self.runs if r.state == "running" and r.proc is not None]
        for _, proc in running:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + LAUNCH_STOP_WAIT_S  # a checkpoint in progress is never cut off
        for run, proc in running:
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            self._finish(run, code, interrupted=True)
        for run in self.runs:
            if run.state == "queued":
                run.note = "not started"

    # ------------------------------------------------------------------ reporting
    def makespan(self) -> tuple[float, float]:
        """(wall time from the first start to the last end, the runs' own durations x their GPUs/slots)
        of this pass: the ideal makespan is the second divided by the size of the pool."""
        ran = [
            (r.started, r.ended, r.share)
            for r in self.runs
            if r.state not in ("skipped", "queued") and r.started and r.ended
        ]
        if not ran:
            return 0.0, 0.0
        work = sum((ended - started) * float(share) for started, ended, share in ran)
        return max(ended for _, ended, _ in ran) - min(started for started, _, _ in ran), work
