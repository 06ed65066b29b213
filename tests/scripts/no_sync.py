"""On a GPU: the Trainer's training steps make no host synchronisation (issue: no hidden .item()).

    multigpu run --gpus 0 no_sync.py OUT [--precision 32|bf16]

After a few warm-up steps, torch.cuda.set_sync_debug_mode("error") is on for every step until two
before the end of the epoch (the epoch's own metrics read the loss there, on purpose): any
synchronising call inside a step - an .item(), a blocking copy, a nonzero() - raises. Progress is on
with a long interval, so its cheap "is it time?" check runs every step without redrawing. Writes
OUT/ok-rank<r>.txt with the number of steps checked.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--precision", default="32")
args = parser.parse_args()
STEPS = 40


class Strict(mg.Trainer):
    checked = 0

    def compute_loss(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)

    def on_train_batch_end(self, step, loss):
        if step == 3:
            torch.cuda.set_sync_debug_mode("error")
        elif step == STEPS - 2:
            torch.cuda.set_sync_debug_mode("default")
        elif step > 3:
            self.checked += 1


run = mg.init(seed=0)
g = torch.Generator().manual_seed(0)
n = STEPS * 16 * run.world_size
data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
trainer = Strict(
    run,
    model,
    lambda p: torch.optim.AdamW(p, lr=1e-3),
    batch_size=16,
    epochs=1,
    precision=args.precision,
    out_dir=str(Path(args.out) / "run"),
    progress=True,
    progress_every_s=3600,
    log_every_n_steps=0,
    clip_grad_norm=None,
    plot=False,
)
trainer.fit(data)
Path(args.out, f"ok-rank{run.rank}.txt").write_text(str(trainer.checked))
