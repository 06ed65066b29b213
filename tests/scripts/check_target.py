"""A user's script for `multigpu check`, with one planted mistake at a time.

    multigpu check --nproc 2 --steps 4 check_target.py [--plant CAUSE] [--trainer]

CAUSE: none, unsharded (a plain DataLoader on every rank), batchnorm, sum_loss (reduction='sum'),
grad_sum (an all-reduce SUM of gradients on top of DDP's average), same_seed (noise augmentation
seeded alike on every rank), unused (a parameter outside the forward), mean_of_means (evaluation
averaged over the ranks' means on uneven shards), drop_last_padding (a dataset that does not divide
evenly: the sampler pads). Correct variants: late_optimizer (built after run.setup), seq_first (the
model's input is (time, batch, ...)), plain_backward (loss.backward() instead of run.backward).
--trainer: the same model through mg.Trainer (plants none/batchnorm).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("--plant", default="none")
parser.add_argument("--trainer", action="store_true")
args = parser.parse_args()
plant = args.plant

run = mg.init(seed=0, timeout_s=60)
g = torch.Generator().manual_seed(1)
n = 101 if plant == "drop_last_padding" else 128
data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
valid = TensorDataset(torch.randn(13, 6, generator=g), torch.randint(0, 3, (13,), generator=g))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(6, 16),
            nn.BatchNorm1d(16) if plant == "batchnorm" else nn.Identity(),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(16, 3),
        )
        self.spare = nn.Linear(3, 3) if plant == "unused" else None

    def forward(self, x):
        return self.body(x)


model = Net()
if args.trainer:

    class Fit(mg.Trainer):
        def compute_loss(self, batch):
            inputs, labels = batch
            return F.cross_entropy(self.model(inputs), labels)

    Fit(
        run,
        model,
        lambda p: torch.optim.SGD(p, lr=0.1),
        batch_size=8,
        epochs=3,
        progress=False,
        plot=False,
        out_dir="unused-by-check",
    ).fit(data)
    raise SystemExit(0)

# the optimizer built after run.setup, from the wrapped model's parameters
if plant == "late_optimizer":
    model, _ = run.setup(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
else:
    model, optimizer = run.setup(model, lambda p: torch.optim.SGD(p, lr=0.1))
if plant == "unsharded":
    loader = DataLoader(data, batch_size=8, shuffle=False)
else:
    loader = run.loader(data, batch_size=8, quiet=True, shuffle=plant != "drop_last_padding")
if plant == "same_seed":
    torch.manual_seed(1234)  # after mg.init: every rank now draws the same noise
step = 0
for _epoch in range(3):
    for inputs, labels in loader:
        if plant == "same_seed":
            inputs = inputs + 0.1 * torch.randn_like(inputs)
        # the model sees (time=1, batch, features): its input's first dimension is not the batch
        if plant == "seq_first":
            logits = model(inputs.unsqueeze(0)).squeeze(0)
        else:
            logits = model(inputs)
        loss = F.cross_entropy(logits, labels, reduction="sum" if plant == "sum_loss" else "mean")
        optimizer.zero_grad()
        if plant == "plain_backward":
            # DDP averages the gradients all the same; only the check cannot see the loss
            loss.backward()
        else:
            run.backward(loss)
        # (one process: no group, as users guard it)
        if plant == "grad_sum" and dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)  # SUM on top of DDP's average: N x the gradient
        if plant == "mean_of_means" and step == 1:
            model.eval()
            with torch.no_grad():
                shard = run.eval_loader(valid, batch_size=16)
                correct = total = 0
                for x, y in shard:
                    correct += (model(x).argmax(1) == y).sum().item()
                    total += len(y)
                accuracy = torch.tensor([correct / total])
                if dist.is_initialized():
                    dist.all_reduce(accuracy, op=dist.ReduceOp.AVG)
            model.train()
        optimizer.step()
        step += 1
