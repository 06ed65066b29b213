"""Worker for benchmarks/restart.py: trains, rank 1 SIGKILLs itself once, the group restarts and resumes.

Writes OUT/killed_at (wall time just before the kill) and OUT/resumed_at (wall time when the first
step after the restart finished).
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

out = Path(sys.argv[1])
run = mg.init(seed=0)


class Bench(mg.Trainer):
    def compute_loss(self, batch):
        step = self.state.global_step
        if run.world.restart_count == 0 and step == 5 and run.rank == 1:
            (out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if run.world.restart_count > 0 and step == self.first_step + 1 and run.is_main and not (out / "resumed_at").exists():
            (out / "resumed_at").write_text(repr(time.time()))
        x, y = batch
        return F.cross_entropy(self.model(x), y)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(640, 32, generator=g), torch.randint(0, 4, (640,), generator=g))
trainer = Bench(run, nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)),
                lambda p: torch.optim.SGD(p, lr=0.1), epochs=1, batch_size=16, checkpoint_every_steps=1,
                out_dir=str(out), progress=False)
trainer.first_step = trainer.state.global_step
trainer.resume()
trainer.first_step = trainer.state.global_step
trainer.fit(data)
