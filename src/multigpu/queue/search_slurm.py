"""``multigpu queue runs.yaml --slurm`` for a ``search:``: its trials as Slurm array tasks, asked, pruned
and told by a queue that stays to follow them (on the login node, or in a small CPU job of its own).

Why the queue stays: a model-based search asks each trial's values when a trial can start, from the
results so far, and prunes by reading each evaluation - both need a process that holds the study.
Hydra's Optuna sweeper and Ray Tune work the same way on clusters. The trials never touch the study:
they report into their folders (a shared file system), the queue answers there.

Each round submits the trials that can start now (``--max-parallel`` at once, default: all the search's
trials) as one array job through :func:`multigpu.queue.slurm_jobs.submit_runs` - the same scripts, run
folders, status files and resubmission as any ``--slurm --array`` run. Ctrl-C stops following: the
jobs go on (their reports are not answered, so they are not pruned) and the same command later picks
up every trial where it is: finished ones are told, running ones followed, failed ones resubmitted.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from multigpu.launch import slurm
from multigpu.queue.run_folder import read_status
from multigpu.queue.scheduler import EntryState
from multigpu.queue.slurm_jobs import submit_runs

#: How often the queue reads the trials' reports and states (each report waits at most this long).
POLL_S = 2.0
#: How often a trial whose job wrote no end state yet is asked about (scontrol).
ASK_SLURM_S = 30.0


def follow_searches(
    searches: Sequence[Any],
    out: Path,
    options: slurm.SlurmOptions,
    max_parallel: Optional[int] = None,
    poll_s: float = POLL_S,
    say: Callable[[str], None] = print,
) -> tuple[int, list[EntryState]]:
    """Run every search to its number of trials; (0 when every trial finished or was pruned, every trial
    as a run: for the summary's ranking)."""
    out = Path(out).resolve()
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    watched: dict[str, EntryState] = {}
    # earlier trials to resubmit (failed, interrupted, never submitted)
    waiting: list[EntryState] = []
    asked_at: dict[str, float] = {}
    every: list[EntryState] = []
    try:
        for search in searches:
            for spec in search.start():
                run = EntryState(spec, out / spec.name)
                every.append(run)
                status = read_status(run.folder)
                if (
                    status.get("state") == "done"
                    and status.get("fingerprint") == spec.fingerprint()
                ):
                    run.state = "skipped"
                elif (
                    status.get("state") == "submitted"
                    and status.get("job_id")
                    and slurm.is_active(status["job_id"])
                ):
                    run.state = "running"
                    watched[spec.name] = run
                    say(f"{spec.name}: following job {status['job_id']}")
                    continue
                else:
                    waiting.append(run)
                search.settle_earlier([run])
        while not stop.is_set():
            for search in searches:
                search.poll(list(watched.values()))
            for name, run in list(watched.items()):
                if _ended(run, asked_at):
                    del watched[name]
                    for search in searches:
                        search.finished(run)
                    say(f"{name}: {run.state}" + (f" ({run.note})" if run.note else ""))
            every += _submit(searches, waiting, watched, out, options, max_parallel)
            if not watched and not waiting:
                break
            stop.wait(poll_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for search in searches:
            search.close()
    if watched:
        say(
            f"stopped following {len(watched)} trial job(s): they go on without pruning; run the same command "
            "again to follow them, tell their results and go on with the search."
        )
        return 130, every
    return (0 if all(run.state in ("done", "skipped") for run in every) else 1), every


def _ended(run: EntryState, asked_at: dict[str, float]) -> bool:
    """Did the trial's job end? Its end state (written by the job) says so; a job that ended without one
    (cancelled, time limit) is found by asking Slurm now and then."""
    status = read_status(run.folder)
    state = status.get("state")
    if state in ("done", "failed", "interrupted"):
        run.state = state
        return True
    now = time.monotonic()
    if now - asked_at.get(run.spec.name, 0.0) < ASK_SLURM_S:
        return False
    asked_at[run.spec.name] = now
    job = status.get("job_id")
    if job and slurm.is_active(job):
        return False
    run.state, run.note = "interrupted", "its job ended without writing its state"
    return True


def _submit(
    searches: Sequence[Any],
    waiting: list[EntryState],
    watched: dict[str, EntryState],
    out: Path,
    options: slurm.SlurmOptions,
    max_parallel: Optional[int],
) -> list[EntryState]:
    """Resubmit the earlier trials that need it, and ask new ones, up to ``max_parallel`` at once; returns
    the new ones."""
    room = (max_parallel or 10**9) - len(watched)
    batch: list[EntryState] = []
    while waiting and len(batch) < room:
        batch.append(waiting.pop(0))
    new = []
    for search in searches:
        while search.wants_more() and len(batch) < room:
            spec = search.ask()
            new.append(EntryState(spec, out / spec.name))
            batch.append(new[-1])
    if not batch:
        return new
    submit_runs([run.spec for run in batch], out, options, array=True)
    for run in batch:
        run.state = "running"
        watched[run.spec.name] = run
    return new
