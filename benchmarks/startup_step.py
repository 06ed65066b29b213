"""Worker for benchmarks/startup.py: start, join the process group, one DDP training step, leave.

What every training script does before its first step: import torch, ``mg.init``, wrap a model, build an
optimizer (torch imports ``torch._dynamo`` then) and step it once.

    multigpu run --nproc 2 benchmarks/startup_step.py
    torchrun --standalone --nproc_per_node=2 benchmarks/startup_step.py
"""

import torch
from torch import nn

import multigpu as mg

run = mg.init(timeout_s=60, seed=0)
model, optimizer = run.setup(nn.Linear(8, 2), lambda params: torch.optim.SGD(params, lr=0.1))
loss = model(torch.ones(4, 8, device=run.device)).square().mean()
loss.backward()
optimizer.step()
print(f"rank {run.rank}: one step, loss {loss.item():.4f}", flush=True)
