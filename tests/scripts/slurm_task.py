"""A task for the Slurm tests: records what it was given, sleeps, and may fail once.

    slurm_task.py out_dir=DIR [sleep=S] [fail_once=1] [fail=CODE]

Each process writes DIR/rank<RANK>.json: its GPU and Slurm environment and when it ran (start, end).
fail_once=1 exits 3 on the first attempt (it leaves DIR/failed-once behind) and succeeds afterwards -
a run that a second `multigpu queue --slurm` should resubmit; fail=CODE always exits CODE.
"""

import json
import os
import sys
import time

args = dict(a.split("=", 1) for a in sys.argv[1:])
out = args["out_dir"]
os.makedirs(out, exist_ok=True)
started = time.time()
time.sleep(float(args.get("sleep", 0)))
names = (
    "CUDA_VISIBLE_DEVICES",
    "SLURM_GPUS_ON_NODE",
    "SLURM_JOB_GPUS",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_JOB_ID",
    "SLURM_CPUS_PER_TASK",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
)
record = {name: os.environ.get(name) for name in names}
record.update(start=started, end=time.time())
with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as handle:
    json.dump(record, handle)
if "fail" in args:
    print("this task fails on purpose", file=sys.stderr)
    sys.exit(int(args["fail"]))
marker = os.path.join(out, "failed-once")
if args.get("fail_once") == "1" and not os.path.exists(marker):
    open(marker, "w").close()
    print("this task fails on its first attempt", file=sys.stderr)
    sys.exit(3)
with open(os.path.join(out, "metrics.csv"), "w") as handle:
    handle.write("epoch,valid_score\n1,0.5\n")
