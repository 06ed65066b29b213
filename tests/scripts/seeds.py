"""Dropout masks per rank after setup: different by default, identical with same_random_streams.

    multigpu run --nproc 2 seeds.py OUT default,same      # OUT/<mode>/rank<r>.json for each mode in turn

Each mode is an ``mg.init`` of its own (the one before closed): one launch for both.
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn

import multigpu as mg

for mode in sys.argv[2].split(","):
    run = mg.init(seed=4, same_random_streams=mode == "same")
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5))
    initial = model[0].weight.detach().clone()  # built before setup: identical on every rank
    model, _ = run.setup(model, lambda p: torch.optim.SGD(p, lr=0.1))
    mask = (run.unwrap(model)[1](torch.ones(1, 64)) == 0).int().flatten().tolist()
    folder = Path(sys.argv[1]) / mode
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{run.rank}.json").write_text(
        json.dumps({"mask": mask, "init": initial.flatten().tolist()})
    )
    run.close()
