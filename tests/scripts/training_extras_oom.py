"""A Trainer step that runs out of GPU memory, with ``memory_snapshot_on_oom`` on (marker ``gpu``).

multigpu run --gpus 0 training_extras_oom.py OUT
"""

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg


class TooBig(mg.Trainer):
    def compute_loss(self, batch):
        free, _ = torch.cuda.mem_get_info()
        # twice what is free
        waste = torch.empty(2 * free // 4 + (1 << 30), dtype=torch.float32, device=self.device)
        return self.model(batch[0]).sum() + waste[:1].sum()


run = mg.init()
trainer = TooBig(
    run,
    nn.Linear(4, 1),
    lambda p: torch.optim.SGD(p, lr=0.1),
    out_dir=sys.argv[1],
    batch_size=4,
    memory_snapshot_on_oom=True,
    progress=False,
    plot=False,
)
trainer.fit(TensorDataset(torch.randn(16, 4)))
