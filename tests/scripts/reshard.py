"""Train with a strategy, checkpoint, and continue at another world size from the same checkpoint.

    multigpu run --nproc 2 reshard.py OUT_DIR --strategy fsdp --batch 6 --epochs 1 --weights W.pt
    multigpu run --nproc 3 reshard.py OUT_DIR --strategy fsdp --batch 4 --epochs 2 --weights W.pt

The global batch (batch x processes) is kept the same, so every continuation must end with the same
parameters. --weights: where rank 0 saves the full final weights. float64, so continuations that differ
only in the order of float sums stay within ~1e-9 (a gradient's ~1e-15 error amplified at most
lr / eps = 2e6 per AdamW step): a bound from the arithmetic, not from luck.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--strategy", default="fsdp")
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--weights", required=True)
args = parser.parse_args()

torch.set_default_dtype(torch.float64)
run = mg.init(seed=3, timeout_s=60)
g = torch.Generator().manual_seed(1)
x = torch.randn(96, 6, generator=g)
y = torch.randint(0, 3, (96,), generator=g)


class Blocks(mg.Trainer):
    def compute_loss(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)


model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
trainer = Blocks(
    run,
    model,
    lambda p: torch.optim.AdamW(p, lr=0.02),
    batch_size=args.batch,
    epochs=args.epochs,
    strategy=args.strategy,
    out_dir=args.out,
    progress=False,
    check_consistency=False,
    plot=False,
)
trainer.fit(TensorDataset(x, y))
weights = run.state_dict(trainer.model)
if run.is_main:
    torch.save(weights, args.weights)
    print(
        f"strategy {trainer.strategy.name} world {run.world_size} step {trainer.state.global_step}",
        flush=True,
    )
