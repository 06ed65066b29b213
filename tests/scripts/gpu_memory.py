"""Take FRACTION of the GPU's memory for a moment (for the packed-queue memory guard test).

    gpu_memory.py FRACTION out_dir=DIR

Writes DIR/metrics.csv when the allocation succeeded; a run held to a smaller share than FRACTION by
`multigpu queue --runs-per-gpu` fails with CUDA's out-of-memory error instead (and the launcher's line).
"""

import os
import sys
import time

import torch

import multigpu as mg

run = mg.init()
fraction = float(sys.argv[1])
out = dict(a.split("=", 1) for a in sys.argv[2:])["out_dir"]
os.makedirs(out, exist_ok=True)
total = torch.cuda.get_device_properties(run.device).total_memory
block = torch.empty(int(fraction * total), dtype=torch.uint8, device=run.device)
block.fill_(1)
torch.cuda.synchronize()
time.sleep(1.0)
with open(os.path.join(out, "metrics.csv"), "w") as handle:
    handle.write(f"epoch,valid_gib\n1,{block.numel() / 2**30:.3f}\n")
