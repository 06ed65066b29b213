"""Counts the collectives the Trainer issues from Python during training steps (DDP's gradient
all-reduces run inside its C++ reducer and are not counted: they are the work, not our overhead).

    multigpu run --nproc 2 collectives.py OUT [--every K] [--seconds-per-step S]

Every torch.distributed collective is wrapped with a counter before multigpu is imported; a hook
records the count after each optimizer step of the second epoch (no checkpoint or validation inside
it). Writes OUT/counts-rank<r>.json: {"steps": [...], "counts": [...], "seconds": elapsed}.
--seconds-per-step S: the preemption agreement's clock reads S seconds per optimizer step instead of the
wall clock, so its time-based spacing does not depend on how busy the machine is ("seconds" is then
that clock's too).
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

COUNT = [0]
NAMES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "monitored_barrier",
)


def counted(function):
    def wrapper(*args, **kwargs):
        COUNT[0] += 1
        return function(*args, **kwargs)

    return wrapper


for name in NAMES:
    setattr(dist, name, counted(getattr(dist, name)))

import multigpu as mg  # noqa: E402  (after the wrapping: every module reads dist.<name> at call time)

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--every", type=int)
parser.add_argument("--seconds-per-step", type=float)
args = parser.parse_args()
out = Path(args.out)


def now() -> float:
    return (
        trainer.state.global_step * args.seconds_per_step
        if args.seconds_per_step
        else time.monotonic()
    )


if args.seconds_per_step:
    from types import SimpleNamespace

    from multigpu.guards import preemption

    preemption.time = SimpleNamespace(monotonic=now)  # the one clock the agreement reads


class Counted(mg.Trainer):
    steps: list = []
    counts: list = []
    epoch_now = 0

    def compute_loss(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)

    def on_epoch_start(self, epoch):
        self.epoch_now = epoch
        if epoch == 2:
            self.started = now()

    def on_train_batch_end(self, step, loss):
        if self.epoch_now == 2:
            self.steps.append(step)
            self.counts.append(COUNT[0])


run = mg.init(seed=0, timeout_s=60)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(640, 8, generator=g), torch.randint(0, 3, (640,), generator=g))
trainer = Counted(
    run,
    nn.Linear(8, 3),
    lambda p: torch.optim.SGD(p, lr=0.1),
    batch_size=4,
    epochs=2,
    out_dir=str(out / "run"),
    progress=True,
    progress_every_s=0.01,
    log_every_n_steps=1,
    stop_check_every=args.every,
    plot=False,
)
trainer.fit(data)
seconds = now() - trainer.started
(out / f"counts-rank{run.rank}.json").write_text(
    json.dumps({"steps": trainer.steps, "counts": trainer.counts, "seconds": seconds})
)
