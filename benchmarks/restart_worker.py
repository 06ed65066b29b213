"""Worker for benchmarks/restart.py: trains, rank 1 SIGKILLs itself once, the group restarts and resumes.

Writes OUT/killed_at (wall time just before the kill) and, from the restarted rank 0, OUT/phases.json:
wall times of its process start (from /proc), the script's first line, ``import torch`` done,
``torch._dynamo`` imported (torch imports it when the first optimizer is built: imported here first so
that its cost is named), ``import multigpu`` done, ``mg.init`` done, the Trainer built, the checkpoint
resumed, the first step finished.
"""

import time

first_line = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

torch_done = time.time()
import torch._dynamo  # noqa: E402,F401 - what torch imports at the first optimizer's construction anyway

dynamo_done = time.time()
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import multigpu as mg  # noqa: E402

multigpu_done = time.time()


def process_start() -> float:
    """This process's start time (the kernel's, 10 ms resolution): before the interpreter ran anything.
    The kernel counts it from boot; the clock since boot read now turns it into wall time. (``btime`` of
    /proc/stat, the boot's wall time, is whole seconds: up to a second moved between the agent's phase and
    the interpreter's, and once gave the agent a negative time.)"""
    with open("/proc/self/stat") as handle:
        ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
    since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since_start


out = Path(sys.argv[1])
run = mg.init(seed=0)
phases = {"process_start": process_start(), "first_line": first_line, "torch_imported": torch_done,
          "dynamo_imported": dynamo_done, "multigpu_imported": multigpu_done, "init_done": time.time()}


class Bench(mg.Trainer):
    def compute_loss(self, batch):
        if run.world.restart_count == 0 and self.state.global_step == 5 and run.rank == 1:
            (out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def on_fit_start(self):
        phases["resumed"] = time.time()

    def on_train_batch_end(self, step, loss):
        if run.world.restart_count > 0 and run.is_main and "first_step" not in phases:
            phases["first_step"] = time.time()
            (out / "phases.json").write_text(json.dumps(phases))


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(640, 32, generator=g), torch.randint(0, 4, (640,), generator=g))
trainer = Bench(run, nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)),
                lambda p: torch.optim.SGD(p, lr=0.1), epochs=1, batch_size=16, checkpoint_every_steps=1,
                out_dir=str(out), progress=False, plot=False, async_checkpoint=False)
phases["trainer_built"] = time.time()
trainer.fit(data)
