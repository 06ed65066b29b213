"""Validation inside epochs, the best checkpoint and early stopping, with any number of processes.

    multigpu run --nproc 2 observe.py OUT --batch 8 [--patience P] [--epochs E]

The data make the validation loss fall, then rise (the model overfits 24 noisy samples): early
stopping must find the same best step and stop at the same step on 1 and on 2 processes.
Writes OUT/result.json (rank 0): best value and step, the step training stopped at, the hooks' calls.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--patience", type=int, default=3)
parser.add_argument("--epochs", type=int, default=40)
parser.add_argument("--loggers", default="")
args = parser.parse_args()
run = mg.init(seed=0, timeout_s=60)
g = torch.Generator().manual_seed(4)
x = torch.randn(24, 6, generator=g)
# noisy labels: overfitting follows
y = (x[:, 0] > 0).long() ^ (torch.rand(24, generator=g) < 0.3).long()
vx = torch.randn(64, 6, generator=g)
vy = (vx[:, 0] > 0).long()


class Observed(mg.Trainer):
    calls: list = []

    def compute_loss(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)

    def on_fit_start(self):
        self.calls.append("fit_start")

    def on_epoch_start(self, epoch):
        self.calls.append(f"epoch_start {epoch}")

    def on_evaluate_start(self):
        self.calls.append("evaluate_start")

    def on_validation_end(self, metrics):
        self.calls.append("validation_end")

    def on_epoch_end(self, epoch, metrics):
        self.calls.append(f"epoch_end {epoch}")

    def on_checkpoint(self, path):
        self.calls.append(f"checkpoint {Path(path).parent.name}")

    def on_fit_end(self):
        self.calls.append("fit_end")


torch.manual_seed(2)
model = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 2))
trainer = Observed(
    run,
    model,
    lambda p: torch.optim.Adam(p, lr=0.05),
    batch_size=args.batch,
    epochs=args.epochs,
    out_dir=args.out,
    progress=False,
    monitor="valid_loss",
    mode="min",
    patience=args.patience,
    eval_every_steps=2,
    log_every_n_steps=1,
    shuffle=False,
    keep_last=2,
    loggers=[n for n in args.loggers.split(",") if n],
)
trainer.fit(TensorDataset(x, y), TensorDataset(vx, vy))
if run.is_main:
    Path(args.out, "result.json").write_text(
        json.dumps(
            {
                "best": trainer.tracker.best,
                "best_step": trainer.tracker.best_step,
                "stopped_at": trainer.state.global_step,
                "calls": trainer.calls,
            }
        )
    )
