"""``multigpu queue --slurm``: each run of the runs file becomes its own Slurm job - or, with
``--array`` (or ``slurm_array: true`` in the runs file), one task of an array job.

The pool is then the cluster's: Slurm places the jobs. Each run still gets its own folder with its
resolved config, and the job's log lands there too (an array's script lives in ``OUT/.slurm/``, which
no run name can be). The local queue's rules hold: a run that finished with the same settings is
skipped, a run whose settings changed starts afresh with its old folder kept aside, and a run whose
job is still queued or running is never submitted again - also when two ``queue --slurm`` commands race
(each run is decided under its lock). The job writes its end state into ``status.json``, so the next
``queue --slurm`` knows what finished: running the same command again resubmits the failed and
interrupted runs only (for an array: one new array of just those). ``--status`` shows the table.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.table import Table
from rich.text import Text

from multigpu.distributed.job import job_env
from multigpu.fileio import atomic_write_text
from multigpu.launch import environment, slurm
from multigpu.queue.lock import RunLock
from multigpu.queue.run_folder import STATUS_FILE, decide, move_aside, read_status, write_run_config
from multigpu.queue.runs import QueueEntry
from multigpu.queue.scheduler import EntryState

#: Inside the queue's folder, where array scripts go (a run name cannot start with a dot).
ARRAYS_FOLDER = ".slurm"


@dataclass
class _Pending:
    index: int
    spec: QueueEntry
    job: slurm.SlurmJob
    note: str


def run_options(options: slurm.SlurmOptions, spec: QueueEntry) -> slurm.SlurmOptions:
    """The job options of one run: GPUs asked for on the command line (any way Slurm takes them) win over
    the run's ``gpus:``; processes: --nproc-per-node, else the run's ``nproc:``, else one per GPU."""
    request = options.gpu_request()
    if request is None:
        options = replace(options, gpus_per_node=int(spec.gpus))
    gpus = options.gpus
    return replace(options, nproc_per_node=options.nproc_per_node or spec.nproc or max(gpus, 1))


def _job(
    spec: QueueEntry, folder: Path, options: slurm.SlurmOptions, job_name: str
) -> slurm.SlurmJob:
    target = ("-m", spec.module) if spec.module else (spec.script,)
    env = {
        **{k: str(v) for k, v in spec.env.items()},  # the run writes only in its folder
        **job_env(None, run_dir=str(folder), **spec.job_changes(folder)),
    }
    _, held = environment.run_environment(os.environ, env)
    return slurm.SlurmJob(
        command=(*target, *spec.recipe_args(folder)),
        run_dir=folder,
        options=replace(run_options(options, spec), job_name=job_name),
        env=tuple(sorted(env.items())),
        unset=tuple(held),
        status_file=folder / STATUS_FILE,
        fingerprint=spec.fingerprint(),
    )


def submit_runs(
    specs: Sequence[QueueEntry],
    out: Path,
    options: slurm.SlurmOptions,
    dry_run: bool = False,
    array: bool = False,
    max_parallel: Optional[int] = None,
) -> int:
    out = Path(out).resolve()
    options.validate()
    names = slurm.short_names([spec.name for spec in specs])
    locks: list[RunLock] = []
    arrayed: list[_Pending] = []
    try:
        for index, spec in enumerate(specs):
            lock = RunLock(out, spec.name)
            if not lock.acquire():
                print(
                    f"{spec.name}: skipped - being submitted by another queue (pid {lock.holder()})"
                )
                continue
            locks.append(lock)
            pending = _prepare(
                index, spec, out / spec.name, options, options.job_name or names[spec.name], dry_run
            )
            if pending is None:
                continue
            if array or spec.slurm_array:
                arrayed.append(pending)
            else:
                _submit_one(pending, dry_run)
        if arrayed:
            _submit_arrays(arrayed, out, options, dry_run, max_parallel)
    finally:
        for lock in locks:
            lock.release()
    return 0


def _prepare(
    index: int,
    spec: QueueEntry,
    folder: Path,
    options: slurm.SlurmOptions,
    job_name: str,
    dry_run: bool,
) -> Optional[_Pending]:
    decision = decide(folder, spec.fingerprint(), active_job=None if dry_run else slurm.is_active)
    if decision.action == "skip":
        print(f"{spec.name}: skipped - {decision.note}")
        return None
    job = _job(spec, folder, options, job_name)
    slurm.render(job)  # every value checked before anything is moved or written
    if dry_run:  # a dry run changes nothing that is there: it only writes the script it shows
        note = (
            "earlier outputs would be moved aside" if decision.action == "fresh" else decision.note
        )
        return _Pending(index, spec, job, note)
    note = move_aside(folder) if decision.action == "fresh" else decision.note
    write_run_config(folder, spec)
    return _Pending(index, spec, job, note)


def _submitted(pending: _Pending, job_id: str, log: Path) -> None:
    atomic_write_text(
        pending.job.run_dir / STATUS_FILE,
        json.dumps(
            {"state": "submitted", "job_id": job_id, "fingerprint": pending.job.fingerprint},
            indent=1,
        ),
    )
    print(
        f"{pending.spec.name}: submitted job {job_id} (log {log})"
        + (f" - {pending.note}" if pending.note else "")
    )


def _submit_one(pending: _Pending, dry_run: bool) -> None:
    if dry_run:
        print(f"{pending.spec.name}: {slurm.write(pending.job)}")
        return
    job_id = slurm.submit(pending.job)
    _submitted(pending, job_id, pending.job.run_dir / f"slurm-{job_id}.out")


def _submit_arrays(
    arrayed: list[_Pending],
    out: Path,
    options: slurm.SlurmOptions,
    dry_run: bool,
    max_parallel: Optional[int],
) -> None:
    """One array job per shape (nodes, GPUs and processes per node): usually one for the whole family."""
    shapes: dict[tuple[Any, ...], list[_Pending]] = {}
    for pending in arrayed:
        o = pending.job.options
        shapes.setdefault((o.nodes, o.gpus, o.processes), []).append(pending)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = options.job_name or slurm.short_names([out.name])[out.name]
    for group in shapes.values():
        folder, number = out / ARRAYS_FOLDER / f"array-{stamp}", 1
        while folder.exists():  # never the script (and task map) of an earlier array
            folder, number = out / ARRAYS_FOLDER / f"array-{stamp}-{number}", number + 1
        array = slurm.SlurmArray(
            tasks={p.index: p.job for p in group},
            folder=folder,
            options=replace(group[0].job.options, job_name=name),
            max_parallel=max_parallel,
        )
        script = slurm.write_array(array)
        runs = ", ".join(p.spec.name for p in group)
        if dry_run:
            print(f"array of {len(group)} run(s) ({runs}): {script}")
            continue
        job_id = slurm.submit_script(script)
        at_once = f", {max_parallel} at a time" if max_parallel else ""
        print(f"submitted array job {job_id} ({name}): {len(group)} task(s){at_once}")
        for pending in group:
            task = f"{job_id}_{pending.index}"
            _submitted(pending, task, pending.job.run_dir / f"slurm-{task}.out")


# ------------------------------------------------------------------------------------ status table


def _shown_state(status: dict[str, Any], records: list[Any]) -> tuple[str, str]:
    """(state, note) of one run: Slurm's while its job is queued or running, else the end state the job
    wrote; a job that ended without writing one (cancelled, time limit, node failure) shows Slurm's."""
    if not status:
        return "not submitted", ""
    record = records[0] if len(records) == 1 else None
    if record is not None and record.active:
        return record.state.lower(), f"{record.reason}" if record.state == "PENDING" else ""
    if status.get("state") in ("done", "failed", "interrupted"):
        return status["state"], ""
    if record is not None:
        return (
            record.state.lower(),
            "ended without writing its state: run the queue again to resubmit it",
        )
    return str(status.get("state", "?")), "Slurm no longer knows its job"


def status_table(specs: Sequence[QueueEntry], out: Path) -> Table:
    """Every run: its job (an array task: 123_4), state, elapsed time, exit code, restarts, last metric."""
    from multigpu.launch import slurm_state
    from multigpu.queue.display import STYLE, headline

    out = Path(out).resolve()
    statuses = {spec.name: read_status(out / spec.name) for spec in specs}
    ids = sorted({str(s["job_id"]) for s in statuses.values() if s.get("job_id")})
    found = slurm_state.records([slurm.check_job_id(i) for i in ids])
    table = Table(title=Text(f"multigpu queue --slurm: {out}"), title_justify="left")
    for column in ("run", "job", "state", "elapsed", "exit", "restarts", "last metric", "note"):
        table.add_column(column)
    for spec in specs:
        status = statuses[spec.name]
        job_id = str(status.get("job_id") or "")
        records = found.get(job_id, [])
        state, note = _shown_state(status, records)
        record = records[0] if len(records) == 1 else None
        exit_code = "" if record is None or record.active else record.exit_code
        metric = headline(EntryState(spec, out / spec.name))
        table.add_row(
            Text(spec.name),
            Text(job_id),
            Text(state, style=STYLE.get(state, "")),
            Text(record.elapsed if record else ""),
            Text(exit_code),
            Text(str(record.restarts) if record else ""),
            Text(metric),
            Text(note),
        )
    return table


def show_status(specs: Sequence[QueueEntry], out: Path) -> int:
    from multigpu.queue.display import console_for_output

    # a log file or a pipe: full lines, not 80 columns
    console_for_output().print(status_table(specs, out))
    return 0
