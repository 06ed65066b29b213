"""Activation checkpointing, weight averaging, the step guard and profiling in one 2-process launch.

    multigpu run --nproc 2 --profile training_extras.py OUT

Every fit trains the same float64 model (4 residual blocks and a head) on the same 48 samples for 2
epochs (6 optimizer steps each) with SGD, ema 0.9 and the step guard, validating on 10 samples after
each epoch (on the averaged weights); rank 1's loss is NaN at step 3, so every rank must skip that step.
Fits, each in OUT/<name>:

- fsdp: without activation checkpointing; records the full weights after every step (for the
  hand-computed EMA in the test) and around the last validation;
- half then resumed: fsdp with activation checkpointing for 1 epoch, then resumed to 2 - must equal
  fsdp bit for bit (checkpointing changes no number, and the resume is exact);
- ddp, ddp_ac: the same pair under DDP.

Rank 0 saves OUT/<name>.pt (final weights, averaged weights, per-step weights); every rank writes
OUT/<name>-rank<R>.json (its step guard's count, its checkpointed blocks).
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.strategies.checkpointing import is_checkpointed

OUT = Path(sys.argv[1])
run = mg.init(seed=0, timeout_s=120)
torch.set_default_dtype(torch.float64)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(8) for _ in range(4)])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


class Fit(mg.Trainer):
    record = False

    def compute_loss(self, batch):
        inputs, targets = batch
        loss = F.mse_loss(self.model(inputs), targets[:, None])
        if self.state.global_step == 2 and self.run.rank == 1:  # step 3, on one rank only
            loss = loss * float("nan")
        return loss

    def on_fit_start(self):
        self.steps = []

    def on_train_batch_end(self, step, loss):
        if self.record:
            self.steps.append(self.run.state_dict(self.model))  # a collective: every rank

    def on_evaluate_start(self):  # before validation swaps the averaged weights in ...
        self.before_eval = self.run.state_dict(self.model) if self.record else {}

    def on_validation_end(self, metrics):  # ... and after it put the model's own back
        self.after_eval = self.run.state_dict(self.model) if self.record else {}


generator = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(48, 8, generator=generator), torch.randn(48, generator=generator))
valid = TensorDataset(torch.randn(10, 8, generator=generator), torch.randn(10, generator=generator))


def fit(
    name: str, strategy: str, epochs: int = 2, record: bool = False, out: str = "", **settings
) -> None:
    torch.manual_seed(0)
    model = Net()
    trainer = Fit(
        run,
        model,
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        strategy=strategy,
        out_dir=str(OUT / (out or name)),
        batch_size=8 // run.dp_size,
        epochs=epochs,
        shuffle=False,
        ema=0.9,
        skip_nonfinite=True,
        log_every_n_steps=1,
        progress=False,
        plot=False,
        **settings,
    )
    trainer.record = record
    trainer.fit(data, valid)
    final = run.state_dict(trainer.model)
    averaged = trainer.extras.averaging.state_dict()["averaged_model"]
    checkpointed = [n for n, m in run.unwrap(trainer.model).named_modules() if is_checkpointed(m)]
    (OUT / f"{name}-rank{run.rank}.json").write_text(
        json.dumps({"skipped": trainer.extras.guard.skipped, "checkpointed": checkpointed})
    )
    if run.is_main:
        torch.save(
            {
                "final": final,
                "averaged": averaged,
                "steps": trainer.steps if record else [],
                "before_eval": trainer.before_eval if record else {},
                "after_eval": trainer.after_eval if record else {},
                "valid": valid.tensors,
            },
            OUT / f"{name}.pt",
        )


fit("fsdp", "fsdp", record=True)
fit("half", "fsdp", epochs=1, activation_checkpointing={"every": 1})
fit("resumed", "fsdp", out="half", activation_checkpointing=True)
fit("ddp", "ddp")
fit("ddp_ac", "ddp", activation_checkpointing={"blocks": ["Block"], "every": 2})
