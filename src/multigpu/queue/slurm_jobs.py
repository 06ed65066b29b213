"""``multigpu queue --slurm``: each run of the runs file becomes its own Slurm job.

The pool is then the cluster's: Slurm places the jobs. Each run still gets its own folder with its
resolved config, and the job's script and log land there too.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import yaml

from multigpu.launch import slurm
from multigpu.queue.runs import RunSpec
from multigpu.queue.scheduler import CONFIG_FILE, STATUS_FILE


def submit_runs(specs: Sequence[RunSpec], out: Path, options: slurm.SlurmOptions, dry_run: bool = False) -> int:
    out = Path(out).resolve()
    for spec in specs:
        folder = out / spec.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(yaml.safe_dump(spec.resolved(), sort_keys=False))
        gpus = spec.gpus if options.gpus_per_node is None else options.gpus_per_node
        run_options = replace(options, job_name=spec.name, gpus_per_node=gpus,
                              nproc_per_node=options.nproc_per_node or spec.processes(gpus > 0))
        target = ("-m", spec.module) if spec.module else (spec.script,)
        job = slurm.SlurmJob(command=(*target, *spec.recipe_args(folder)), run_dir=folder, options=run_options,
                             env=tuple(sorted((k, str(v)) for k, v in spec.env.items())))
        if dry_run:
            print(f"{spec.name}: {slurm.write(job)}")
            continue
        job_id = slurm.submit(job)
        (folder / STATUS_FILE).write_text(json.dumps({"state": "submitted", "job_id": job_id,
                                                      "fingerprint": spec.fingerprint()}, indent=1))
        print(f"{spec.name}: submitted job {job_id} (log {folder / f'slurm-{job_id}.out'})")
    return 0
