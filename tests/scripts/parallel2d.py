"""A tiny GPT trained by the Trainer with any strategy and degrees; saves the full final weights.

    multigpu run --nproc 4 parallel2d.py OUT --strategy fsdp+tp --tp 2 --steps 6 --batch 2
    multigpu run --nproc 1 parallel2d.py OUT --strategy single --steps 6 --batch 4
    multigpu run --nproc 1 parallel2d.py --plan PLAN.json    # several runs in turn: a JSON list of argvs

The global batch is batch x data-parallel ranks (world / tp): keep it equal across runs to compare.
--kill-at S   rank 1 SIGKILLs itself while computing step S+1 (first attempt only; use --max-restarts)
--plan        each run starts with every random stream seeded as mg.init(seed=1) seeds a fresh process

float64 throughout: runs that differ only in the order of float sums then stay within ~1e-9 of each
other after 6 AdamW steps (a gradient's error ~1e-15, amplified at most lr / eps = 3e5 per step);
in float32 that amplification turned 1e-7 noise into 5e-5 (a bound that held by luck). final.pt holds
the full weights and every step's global mean loss.
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.checkpoint.rng import seed_everything

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--strategy", default="auto")
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--dp-replicate", type=int, default=1)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--kill-at", type=int)
parser.add_argument("--clip", type=float)
if sys.argv[1:2] == ["--plan"]:
    with open(sys.argv[2]) as handle:
        plan = [parser.parse_args(argv) for argv in json.load(handle)]
else:
    plan = [parser.parse_args()]
args = plan[0]

VOCAB, WIDTH, HEADS, T, LAYERS = 32, 16, 4, 8, 2
torch.set_default_dtype(torch.float64)
run = mg.init(seed=1, timeout_s=60)
losses: list = []


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v = (
            nn.Linear(WIDTH, WIDTH),
            nn.Linear(WIDTH, WIDTH, bias=False),
            nn.Linear(WIDTH, WIDTH),
        )
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        head_dim = WIDTH // HEADS
        q, k, v = self.q(h), self.k(h), self.v(h)
        heads = q.shape[-1] // head_dim
        q, k, v = (z.view(b, t, heads, head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, heads * head_dim))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)

    def forward(self, idx):
        return self.tokens(idx)


def make_model():
    model = nn.Sequential(
        Embed(), *(Block() for _ in range(LAYERS)), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
    )
    model.tp_plan = {
        "*.q": "colwise",
        "*.k": "colwise",
        "*.v": "colwise",
        "*.proj": "rowwise",
        "*.mlp.0": "colwise",
        "*.mlp.2": "rowwise",
    }
    return model


class LM(mg.Trainer):
    def compute_loss(self, batch):
        step = self.state.global_step
        if (
            args.kill_at is not None
            and step == args.kill_at
            and run.rank == 1
            and run.world.restart_count == 0
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = batch
        logits = self.model(inputs)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def on_train_batch_end(self, step, loss):  # every rank's loss (equal batches): the global mean
        losses.append(run.reduce({"loss": (loss.item(), 1)})["loss"])


def train() -> None:
    """One run of ``args`` (read by LM too): the model, the Trainer, final.pt."""
    out = Path(args.out)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (64, T + 1), generator=g)
    dataset = TensorDataset(data[:, :-1], data[:, 1:])
    trainer = LM(
        run,
        make_model(),
        lambda p: torch.optim.AdamW(p, lr=3e-3),
        batch_size=args.batch,
        epochs=100,
        max_steps=args.steps,
        strategy=args.strategy,
        tp=args.tp,
        dp_replicate=args.dp_replicate,
        out_dir=str(out),
        checkpoint_every_steps=1,
        keep_last=100,
        progress=False,
        shuffle=False,
        clip_grad_norm=args.clip,
        log_every_n_steps=0,
        plot=False,
    )
    trainer.fit(dataset)
    weights = run.state_dict(trainer.state_model)
    if run.is_main:
        torch.save({"weights": weights, "losses": torch.tensor(losses)}, out / "final.pt")
        print(
            f"done strategy={trainer.strategy.name} world={run.world_size} dp={run.dp_size} "
            f"step={trainer.state.global_step} out={out.name}",
            flush=True,
        )


for planned in plan:
    args = planned
    seed_everything(1)  # as mg.init(seed=1) left a fresh process
    losses.clear()
    train()
