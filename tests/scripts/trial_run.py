"""A sweep trial for the queue tests: an own loop that reports a made-up validation loss with
``run.report`` after each of its steps, and stops when the queue's search prunes it.

    trial_run.py out_dir=DIR x=0.3 [steps=4] [sleep=0]

loss(step) = 1/step where x <= 0.6 (a flat good region: no good trial is worse than another), and
10 + 1/step where x > 0.6 (the planted bad region). Writes metrics.csv (step,valid_loss) and, at the
end, done.json ({"pruned": ..., "last_step": ...}).
"""

import json
import os
import sys
import time

import multigpu as mg

args = dict(a.split("=", 1) for a in sys.argv[1:])
out, x, steps = args["out_dir"], float(args["x"]), int(args.get("steps", 4))
os.makedirs(out, exist_ok=True)
run = mg.init()
pruned, step = False, 0
with open(os.path.join(out, "metrics.csv"), "w") as handle:
    handle.write("step,valid_loss\n")
    for step in range(1, steps + 1):
        time.sleep(float(args.get("sleep", 0)))
        loss = (10.0 if x > 0.6 else 0.0) + 1.0 / step
        handle.write(f"{step},{loss}\n")
        handle.flush()
        if run.report(loss, step):
            pruned = True
            break
with open(os.path.join(out, "done.json"), "w") as handle:
    json.dump({"pruned": pruned, "last_step": step}, handle)
