"""run_on_main: the side effect happens once, takes longer than the collective timeout, and its
result reaches every rank. Usage: prepare_once.py OUT_DIR [--fail]"""

import json
import os
import sys
import time

import torch.distributed as dist

import multigpu as mg

out = sys.argv[1]
fail = "--fail" in sys.argv
run = mg.init(timeout_s=5)  # preparation below takes longer than this on purpose


def prepare(folder):
    with open(os.path.join(folder, "prepared.txt"), "a") as handle:
        handle.write(f"prepared by rank {dist.get_rank()}\n")
    time.sleep(7)
    if fail:
        raise RuntimeError("the dataset is broken")
    return {"items": 101, "by": dist.get_rank()}


result = mg.run_on_main(prepare, out)
second = mg.run_on_main(lambda: run.rank)  # a second call uses its own key
nothing = mg.run_on_main(lambda: None)
with open(os.path.join(out, f"result{run.rank}.json"), "w") as handle:
    json.dump({"result": result, "second": second, "nothing": nothing}, handle)
mg.rank_zero_print("printed once")
