"""A script that catches KeyboardInterrupt and goes on (as pytorch/examples' word_language_model does):
after Ctrl-C it evaluates - a collective the other ranks may never join. Every rank must be out within
seconds, not after the collective timeout.

    multigpu run --nproc 2 interrupt.py OUT
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

out = Path(sys.argv[1])
# a long collective timeout: only the interrupt handling can be fast
run = mg.init(seed=0, timeout_s=300)
data = TensorDataset(torch.randn(4000, 8), torch.randint(0, 4, (4000,)))


class Slow(mg.Trainer):
    def compute_loss(self, batch):
        time.sleep(0.05)
        if self.state.global_step == 3 and run.rank == 0:
            (out / "training").write_text("yes")
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)


trainer = Slow(
    run,
    nn.Linear(8, 4),
    lambda p: torch.optim.SGD(p, lr=0.1),
    batch_size=8,
    epochs=100,
    out_dir=str(out),
    progress=False,
    plot=False,
    log_every_n_steps=0,
)
try:
    trainer.fit(data)
except KeyboardInterrupt:
    print(f"rank {run.rank}: exiting from training early", flush=True)
metrics = trainer.evaluate(data)  # what the example does next: needs every rank
print(f"rank {run.rank}: test loss {metrics['loss']:.3f}", flush=True)
