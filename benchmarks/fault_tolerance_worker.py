"""Worker for benchmarks/fault_tolerance.py: a Trainer whose steps take a fixed time; one process SIGKILLs
itself once, in the middle of step KILL_AT+1 (after its forward).

    python fault_tolerance_worker.py OUT --kill-at K --steps N --step-s S --checkpoint-every C

Rank 0 of each replica group appends {"step", "t", "live", "attempt"} to OUT/steps-g<G>.jsonl after every
batch; the victim writes OUT/killed (wall time) just before it dies. The victim is rank 1 of a plain job
(the whole job then restarts from its last checkpoint), or group 1 in a job of replica groups (the other
group keeps stepping; group 1 restarts and heals).
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--kill-at", type=int, default=25)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--step-s", type=float, default=0.1)
parser.add_argument("--checkpoint-every", type=int, default=10)
args = parser.parse_args()

run = mg.init(seed=0)
out = Path(args.out)
group = run.world.replica_group
victim = (group == 1) if run.world.lighthouse else (run.rank == 1)


class Bench(mg.Trainer):
    def compute_loss(self, batch):
        step = self.state.global_step
        time.sleep(args.step_s)  # the step's compute
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        if victim and step == args.kill_at and run.world.restart_count == 0:
            (out / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    def on_train_batch_end(self, step, loss):
        if run.rank == 0:
            live = self.strategy.participants() if run.world.lighthouse else 1
            with open(out / f"steps-g{group}.jsonl", "a") as handle:
                handle.write(
                    json.dumps(
                        {
                            "step": step,
                            "t": time.time(),
                            "live": live,
                            "attempt": run.world.restart_count,
                        }
                    )
                    + "\n"
                )


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g))
trainer = Bench(
    run,
    nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)),
    lambda p: torch.optim.SGD(p, lr=0.1),
    epochs=1000,
    max_steps=args.steps,
    batch_size=16,
    checkpoint_every_steps=args.checkpoint_every,
    out_dir=str(out / "run"),
    progress=False,
    plot=False,
)
trainer.fit(data)
