"""A word-LM-style stateful model (pytorch/examples' word_language_model, in small): an LSTM over a
token stream, the hidden state carried from batch to batch. Each rank reads its own columns of the
stream (``split_by_node``), in time order; its hidden state is per-rank state in every checkpoint.

    multigpu run --nproc 2 stateful_lm.py OUT [--sleep S] [--hold-at STEP]

--hold-at: every rank waits at that step until a stop signal arrives (hold.py).
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hold import hold, released
from torch import nn
from torch.utils.data import IterableDataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--hold-at", type=int)
args, _unknown = parser.parse_known_args()  # a test may append a token to find leftover processes
VOCAB, BPTT, COLUMNS = 20, 5, 4  # columns per rank
run = mg.init(seed=0, timeout_s=60)
stream = torch.randint(0, VOCAB, (3000,), generator=torch.Generator().manual_seed(9))


class Chunks(IterableDataset):
    """Time chunks of the stream laid out in columns (word_language_model's batchify), this rank's columns."""

    def __init__(self, rank=0, world=1):
        self.rank, self.world = rank, world

    def split_by_node(self, rank, world):
        return Chunks(rank, world)

    def __iter__(self):
        columns = COLUMNS * self.world
        length = len(stream) // columns
        grid = stream[: length * columns].view(columns, length).t()  # (time, all columns)
        mine = grid[:, self.rank * COLUMNS : (self.rank + 1) * COLUMNS]
        for t in range(0, length - 1 - BPTT, BPTT):
            yield mine[t : t + BPTT], mine[t + 1 : t + 1 + BPTT]


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.lstm, self.head = (
            nn.Embedding(VOCAB, 16),
            nn.LSTM(16, 16),
            nn.Linear(16, VOCAB),
        )

    def forward(self, tokens, hidden):
        output, hidden = self.lstm(self.embed(tokens), hidden)
        return self.head(output), hidden


class Trainer(mg.Trainer):
    hidden = None

    def compute_loss(self, batch):
        time.sleep(args.sleep)
        if self.state.global_step == args.hold_at and not released(Path(args.out)):
            hold(Path(args.out), run)
        inputs, targets = batch[0][0], batch[1][0]  # batch_size 1: one time chunk (BPTT x columns)
        hidden = (
            self.hidden
            if self.hidden is not None
            else (torch.zeros(1, COLUMNS, 16), torch.zeros(1, COLUMNS, 16))
        )
        logits, hidden = self.model(inputs, hidden)
        self.hidden = tuple(h.detach() for h in hidden)  # truncated backpropagation through time
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def rank_state(self):
        return {"hidden": list(self.hidden)} if self.hidden is not None else None

    def load_rank_state(self, state):
        self.hidden = tuple(state["hidden"])


torch.manual_seed(1)
trainer = Trainer(
    run,
    LM(),
    lambda p: torch.optim.SGD(p, lr=0.5),
    batch_size=1,
    epochs=1,
    out_dir=args.out,
    checkpoint_every_steps=1,
    keep_last=3,
    progress=False,
    plot=False,
    log_every_n_steps=0,
    stop_check_every=1,
)
trainer.fit(Chunks())
weights = run.state_dict(trainer.model)
hidden = [h.clone() for h in trainer.hidden]
if run.is_main:
    torch.save(weights, Path(args.out) / "final.pt")
torch.save(hidden, Path(args.out) / f"hidden-rank{run.rank}.pt")
run.print(f"done step {trainer.state.global_step}")
