"""A run of fixed length for the queue tests: sleeps, writes metrics.csv into its out dir.

    sleep_run.py SECONDS out_dir=DIR [fail=1]
"""

import os
import sys
import time

args = dict(a.split("=", 1) for a in sys.argv[2:])
out = args["out_dir"]
os.makedirs(out, exist_ok=True)
time.sleep(float(sys.argv[1]))
if args.get("fail") == "1":
    print("this run fails on purpose", file=sys.stderr)
    sys.exit(4)
with open(os.path.join(out, "metrics.csv"), "w") as handle:
    handle.write(f"epoch,valid_score\n1,{float(args.get('score', 0.5))}\n")
