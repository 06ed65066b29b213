"""A run of fixed length for the queue tests: sleeps, writes metrics.csv into its out dir.

    sleep_run.py SECONDS out_dir=DIR [fail=1] [until=PATH]

until=PATH: first wait until PATH exists (a test releases the run when it has seen it running).

Writes env.json (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS as it saw them, and the memory_fraction and run_dir
of its job, MULTIGPU_JOB) too,
and launcher.json: its launcher's command line and the name of the launcher's parent (a queue's launcher
forked from the queue's server shows the queue's command line, and ``multigpu-fork``).
"""

import json
import os
import sys
import time

args = dict(a.split("=", 1) for a in sys.argv[2:])
out = args["out_dir"]
os.makedirs(out, exist_ok=True)
names = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
job = json.loads(os.environ.get("MULTIGPU_JOB") or "{}")
with open(os.path.join(out, "env.json"), "w") as handle:
    json.dump(
        {
            **{name: os.environ.get(name) for name in names},
            "memory_fraction": job.get("memory_fraction"),
            "run_dir": job.get("run_dir"),
        },
        handle,
    )
# what the queue handed it (a {run:NAME} resolved)
with open(os.path.join(out, "args.json"), "w") as handle:
    json.dump(args, handle)
launcher = (job.get("workers") or {}).get("agent_pid")
if launcher:
    with open(f"/proc/{launcher}/cmdline", "rb") as cmdline, open(f"/proc/{launcher}/stat") as stat:
        argv = cmdline.read().decode(errors="replace").split("\0")[:-1]
        parent = stat.read().rsplit(")", 1)[1].split()[1]
    with (
        open(f"/proc/{parent}/comm") as comm,
        open(os.path.join(out, "launcher.json"), "w") as handle,
    ):
        json.dump({"argv": argv, "parent": comm.read().strip()}, handle)
while "until" in args and not os.path.exists(args["until"]):
    time.sleep(0.02)
time.sleep(float(sys.argv[1]))
if args.get("fail") == "1":
    print("this run fails on purpose", file=sys.stderr)
    sys.exit(4)
with open(os.path.join(out, "metrics.csv"), "w") as handle:
    handle.write(f"epoch,valid_score\n1,{float(args.get('score', 0.5))}\n")
