"""``multigpu queue --slurm``: each run of the runs file becomes its own Slurm job.

The pool is then the cluster's: Slurm places the jobs. Each run still gets its own folder with its
resolved config, and the job's script and log land there too. The local queue's rules hold: a run
that finished with the same settings is skipped, a run whose settings changed starts afresh with
its old folder kept aside, and a run whose job is still queued or running is never submitted again -
also when two ``queue --slurm`` commands race (each run is decided under its lock). The job writes
its end state into ``status.json``, so the next ``queue --slurm`` knows what finished.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from multigpu.launch import slurm
from multigpu.queue.lock import RunLock
from multigpu.queue.runs import QueueEntry
from multigpu.fileio import atomic_write_text
from multigpu.queue.scheduler import STATUS_FILE, decide, move_aside, write_run_config


def submit_runs(specs: Sequence[QueueEntry], out: Path, options: slurm.SlurmOptions, dry_run: bool = False) -> int:
    out = Path(out).resolve()
    options.validate()
    for spec in specs:
        folder = out / spec.name
        lock = RunLock(out, spec.name)
        if not lock.acquire():
            print(f"{spec.name}: skipped - being submitted by another queue (pid {lock.holder()})")
            continue
        try:
            _submit_one(spec, folder, options, dry_run)
        finally:
            lock.release()
    return 0


def _submit_one(spec: QueueEntry, folder: Path, options: slurm.SlurmOptions, dry_run: bool) -> None:
    fingerprint = spec.fingerprint()
    decision = decide(folder, fingerprint, active_job=None if dry_run else slurm.is_active)
    if decision.action == "skip":
        print(f"{spec.name}: skipped - {decision.note}")
        return
    note = move_aside(folder) if decision.action == "fresh" else decision.note
    write_run_config(folder, spec)
    gpus = spec.gpus if options.gpus_per_node is None else options.gpus_per_node
    run_options = replace(options, job_name=spec.name, gpus_per_node=gpus,
                          nproc_per_node=options.nproc_per_node or spec.processes(gpus > 0))
    target = ("-m", spec.module) if spec.module else (spec.script,)
    job = slurm.SlurmJob(command=(*target, *spec.recipe_args(folder)), run_dir=folder, options=run_options,
                         env=tuple(sorted((k, str(v)) for k, v in spec.env.items())),
                         status_file=folder / STATUS_FILE, fingerprint=fingerprint)
    if dry_run:
        print(f"{spec.name}: {slurm.write(job)}")
        return
    job_id = slurm.submit(job)
    atomic_write_text(folder / STATUS_FILE, json.dumps({"state": "submitted", "job_id": job_id,
                                                        "fingerprint": fingerprint}, indent=1))
    print(f"{spec.name}: submitted job {job_id} (log {folder / f'slurm-{job_id}.out'})" + (f" - {note}" if note else ""))
