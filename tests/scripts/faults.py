"""A small Trainer run (with dropout, so RNG state matters) for the fault-tolerance tests.

    multigpu run --nproc 2 faults.py OUT_DIR [--kill-at STEP] [--kill-rank R] [--sleep S] ...

Saves a checkpoint every step and, at the end, the final parameters to OUT_DIR/final.pt.
--kill-at STEP[,STEP...]  SIGKILL rank --kill-rank while computing step STEP+1, once per STEP (the first
                    attempt to reach it: OUT/killed-at-STEP marks it; a list kills one attempt after another)
--sleep S           sleep S seconds in every step (gives a test time to send signals)
--hang-at STEP      rank --kill-rank blocks forever in its data loader at that step
--desync            rank 1 builds a wider model than rank 0
--ballast MB        add MB of data to each checkpoint
--hold-at STEP      every rank waits at that step until a stop signal reached it or another rank (hold.py)
--block-save-at STEP  the checkpoint of that step never finishes: its writer blocks inside the write, after
                    writing OUT/saving (a test kills the job there, mid-write, every time)
--hang-timeout S    the watchdog's timeout
--async-checkpoint  write checkpoints in the background (off here: these tests name the step resumed from)
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hold import hold, released
from torch import nn
from torch.utils.data import Dataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument(
    "--kill-at", type=lambda text: [int(step) for step in text.split(",")], default=[]
)
parser.add_argument("--kill-rank", type=int, default=1)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--hang-at", type=int)
parser.add_argument("--desync", action="store_true")
parser.add_argument("--ballast", type=int, default=0)
parser.add_argument("--hold-at", type=int)
parser.add_argument("--block-save-at", type=int)
parser.add_argument("--hang-timeout", type=float, default=60.0)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--async-checkpoint", action="store_true")
# these runs are short: agree every step
parser.add_argument("--stop-check-every", type=int, default=1)
args, _unknown = parser.parse_known_args()  # a test may append a token to find leftover processes

run = mg.init(seed=0, timeout_s=60)
out = Path(args.out)


class Data(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(96, 10, generator=g)
        self.y = torch.randint(0, 3, (96,), generator=g)
        self.trainer = None

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        if args.hang_at is not None and self.trainer is not None and run.rank == args.kill_rank:
            if self.trainer.state.global_step >= args.hang_at:
                while True:  # stuck in the data loader, e.g. a dead network filesystem
                    time.sleep(1)
        return self.x[index], self.y[index]


class Blocker:
    """Pickled inside a checkpoint write: says so, then never returns."""

    def __reduce__(self):
        (out / "saving").write_text(str(run.rank))
        while True:
            time.sleep(1)


class FaultTrainer(mg.Trainer):
    def compute_loss(self, batch):
        step = self.state.global_step
        if args.hold_at is not None and step == args.hold_at and not released(out):
            hold(out, run)
        marker = out / f"killed-at-{step}"
        if (
            step in args.kill_at
            and run.rank == args.kill_rank
            and run.world.restart_count == 0
            and not marker.exists()
        ):
            marker.write_text("killed")  # the next attempt must not kill itself here again
            os.kill(os.getpid(), signal.SIGKILL)
        if args.sleep:
            time.sleep(args.sleep)
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)

    def checkpoint_state(self):
        state = super().checkpoint_state()
        if args.ballast:
            state["ballast"] = torch.ones(args.ballast * 2**18)  # MB of float32
        if args.block_save_at is not None and self.state.global_step == args.block_save_at:
            state["blocker"] = Blocker()
        return state


width = 24 if not (args.desync and run.rank == 1) else 32
model = nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width, 3))
data = Data()
trainer = FaultTrainer(
    run,
    model,
    lambda p: torch.optim.AdamW(p, lr=0.01),
    epochs=args.epochs,
    batch_size=8,
    checkpoint_every_steps=1,
    keep_last=3,
    out_dir=str(out),
    progress=False,
    plot=False,
    accumulate=args.accumulate,
    stop_check_every=args.stop_check_every,
    hang_timeout_s=args.hang_timeout,
    hang_notice_s=args.hang_timeout / 2,
    async_checkpoint=args.async_checkpoint,
)
data.trainer = trainer
trainer.fit(data)
if run.is_main:
    torch.save(trainer.strategy.unwrap(trainer.model).state_dict(), out / "final.pt")
    (out / "steps.txt").write_text(str(trainer.state.global_step))
