"""A tiny GPT trained by the Trainer with pipeline stages across processes (pp), once per configuration in
turn (one launch, several runs: STRATEGY:SCHEDULE[:FOLDER[:ACCUMULATE]], the batch then split into
ACCUMULATE micro-steps of batch / ACCUMULATE); each saves its full final weights, every
step's global loss and an exact validation loss in OUT/STRATEGY-SCHEDULE/final.pt (or OUT/FOLDER). A
configuration whose final.pt exists is skipped: a restarted or relaunched job goes on where it was.

    multigpu run --nproc 2 pipeline_train.py OUT --pp 2 --batch 8 --runs ddp:gpipe,ddp:1f1b,ddp:interleaved_1f1b
    multigpu run --nproc 4 pipeline_train.py OUT --pp 2 --batch 4 --runs ddp:1f1b,fsdp:1f1b
    multigpu run --nproc 8 pipeline_train.py OUT --pp 2 --tp 2 --batch 4 --runs fsdp+tp:1f1b
    multigpu run --nproc 1 pipeline_train.py OUT --batch 8 --runs single:-     # the reference, in OUT/single

The global batch is batch x data-parallel ranks (world / (pp x tp)): keep it equal across runs to compare.
--kill-at S     rank 1 SIGKILLs itself after step S+1 of the last configuration (first attempt only, before
                that step's checkpoint)
--preempt-at S  the last rank sends itself SIGUSR1 after step S of the last configuration (once): every rank
                stops at the same step, checkpoints and exits 75; launched again, the run resumes
--clip C        clip the gradient norm (across stages and meshes) at C

float64 throughout: runs that differ only in the order of float sums (micro-batches, reductions) stay
within ~1e-9 of each other after 6 AdamW steps (tests/scripts/parallel2d.py gives the arithmetic).
Validation: 13 samples, so data-parallel shards, batches and micro-batches are uneven.
"""

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--runs", default="auto:1f1b")
parser.add_argument("--pp", type=int, default=1)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--micro-batches", type=int)
parser.add_argument("--split-points", default="")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--kill-at", type=int)
parser.add_argument("--preempt-at", type=int)
parser.add_argument("--clip", type=float)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--hang", type=float, default=120.0)
# a marker in the command line: the test finds leftover processes by it
parser.add_argument("--token")
args = parser.parse_args()

VOCAB, WIDTH, HEADS, T = 32, 16, 4, 8
torch.set_default_dtype(torch.float64)
run = mg.init(seed=1, timeout_s=60)


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
    torch.manual_seed(1)
    model = nn.Sequential(
        Embed(),
        *(Block() for _ in range(args.layers)),
        nn.LayerNorm(WIDTH),
        nn.Linear(WIDTH, VOCAB),
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
    losses: list

    def compute_loss(self, batch):
        inputs, targets = batch
        logits = self.model(inputs)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def evaluate_batch(self, batch):
        inputs, targets = batch
        logits = self.model(inputs)
        return {
            "loss": (
                F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum"),
                targets.numel(),
            )
        }

    interrupted = False

    def on_train_batch_end(self, step, loss):  # every rank's loss (equal batches): the global mean
        if (
            self.interrupted
            and args.kill_at is not None
            and step == args.kill_at + 1
            and run.rank == 1
            and run.world.restart_count == 0
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        if (
            self.interrupted
            and args.preempt_at is not None
            and step == args.preempt_at
            and run.rank == run.world_size - 1
            and not (Path(self.settings.out_dir) / "preempted").exists()
        ):
            (Path(self.settings.out_dir) / "preempted").write_text(str(step))
            os.kill(os.getpid(), signal.SIGUSR1)
        self.losses.append(run.reduce({"loss": (loss.item(), 1)})["loss"])


g = torch.Generator().manual_seed(7)
data = torch.randint(0, VOCAB, (64 + 13, T + 1), generator=g)
train_set = TensorDataset(data[:64, :-1], data[:64, 1:])
valid_set = TensorDataset(data[64:, :-1], data[64:, 1:])
points = [p if not p.isdigit() else int(p) for p in args.split_points.split(",") if p]
configurations = args.runs.split(",")
for configuration in configurations:
    strategy, schedule, *folder = configuration.split(":")
    out = Path(args.out) / (
        folder[0] if folder else strategy if schedule == "-" else f"{strategy}-{schedule}"
    )
    accumulate = int(folder[1]) if len(folder) > 1 else 1
    if (out / "final.pt").exists():
        continue
    pipeline = (
        {
            "pipeline_schedule": schedule,
            "micro_batches": args.micro_batches,
            "split_points": points or None,
        }
        if args.pp > 1
        else {}
    )
    trainer = LM(
        run,
        make_model(),
        lambda p: torch.optim.AdamW(p, lr=3e-3),
        batch_size=args.batch // accumulate,
        accumulate=accumulate,
        epochs=100,
        max_steps=args.steps,
        strategy=strategy,
        tp=args.tp,
        pp=args.pp,
        out_dir=str(out),
        stop_check_every=1,
        checkpoint_every_steps=1,
        keep_last=100,
        progress=False,
        shuffle=False,
        clip_grad_norm=args.clip,
        log_every_n_steps=0,
        plot=False,
        eval_batch_size=4,
        hang_timeout_s=args.hang,
        **pipeline,
    )
    trainer.losses, trainer.interrupted = [], configuration == configurations[-1]
    trainer.fit(train_set)
    valid = trainer.evaluate(valid_set)
    weights = run.state_dict(trainer.state_model)
    if run.is_main:
        torch.save(
            {"weights": weights, "losses": torch.tensor(trainer.losses), "valid": valid["loss"]},
            out / "final.pt",
        )
        print(
            f"done {configuration} strategy={trainer.strategy.name} world={run.world_size} dp={run.dp_size} "
            f"step={trainer.state.global_step} valid={valid['loss']!r}",
            flush=True,
        )
