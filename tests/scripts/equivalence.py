"""Train a small model for a few steps and save its final parameters, for the equivalence tests.

    multigpu run --nproc 2 equivalence.py OUT --batch 4 ...   vs   multigpu run --nproc 1 equivalence.py OUT --batch 8

Options: --batch B (per process) --steps S (optimizer steps per epoch) --epochs E --accumulate A
--clip C --mode trainer|loop --strategy NAME --precision P --optimizer sgd|adamw
The dataset holds exactly S x A x global-batch samples, so both runs see the same global batches.

    multigpu run --nproc 2 equivalence.py --plan PLAN.json

trains several configurations one after the other in one launch (the tests' way: a launch costs ~5 s,
a configuration a fraction of a second): PLAN.json is a list of argument lists, each the arguments of
one run above (OUT first); arguments after PLAN.json are ignored (the tests' marker for leftovers).
Before each, every random stream is seeded as ``mg.init(seed=1234)`` seeds a fresh process, and each
builds its own data, model, optimizer and Trainer, so it ends with the parameters a launch of its own
would end with.

Everything is float64, so the bound of a comparison follows from the arithmetic rather than from luck:
two runs differ only in the order of float sums (relative error ~1e-15 of a gradient), and AdamW
amplifies a gradient's error by at most lr / eps = 1e6 per step (an element whose gradient is ~0 turns
its noise into an update of that size) - at most ~1e-9 per step, ~1e-8 over the 12 steps. In float32
the same amplification turns ~1e-7 noise into updates of ~lr: no bound holds. OUT holds the weights
and the global mean loss of every micro-batch (every rank's loss averaged: equal batches on each rank).
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.checkpoint.rng import seed_everything

SEED = 1234
parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--global-batch", type=int, required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--clip", type=float, default=None)
parser.add_argument("--mode", default="trainer")
parser.add_argument("--strategy", default="auto")
parser.add_argument("--precision", default="32")
parser.add_argument("--optimizer", default="adamw")
parser.add_argument("--tokens", default="")


def make_model():
    return nn.Sequential(
        nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def train(run, args) -> None:
    """One configuration from scratch; rank 0 saves its weights and per-micro-batch global losses to args.out."""
    seed_everything(SEED)  # as mg.init(seed=SEED) left a fresh process
    losses: list[float] = []
    size = args.steps * args.accumulate * args.global_batch
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(size, 12, generator=generator)
    y = (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 1).long()
    dataset = TensorDataset(x, y)

    def make_optimizer(params):
        if args.optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.2, momentum=0.9)
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)

    class Equivalence(mg.Trainer):
        def compute_loss(self, batch):
            inputs, labels = batch
            return F.cross_entropy(self.model(inputs), labels)

        def on_train_batch_end(self, step, loss):
            losses.append(run.reduce({"loss": (loss.item(), 1)})["loss"])

    if args.mode == "trainer":
        trainer = Equivalence(
            run,
            make_model(),
            make_optimizer,
            batch_size=args.batch,
            epochs=args.epochs,
            accumulate=args.accumulate,
            clip_grad_norm=args.clip,
            strategy=args.strategy,
            precision=args.precision,
            out_dir=args.out + ".run",
            resume=False,
            progress=False,
            plot=False,
        )
        trainer.fit(dataset)
        model = trainer.model
    else:  # the PyTorch-tutorial loop, with the same helpers
        model, optimizer = run.setup(make_model(), make_optimizer, strategy=args.strategy)
        loader = run.loader(dataset, batch_size=args.batch, seed=0)
        for _ in range(args.epochs):  # the loader reshuffles every epoch by itself
            for index, (inputs, labels) in enumerate(loader):
                inputs, labels = inputs.to(run.device), labels.to(run.device)
                boundary = (index + 1) % args.accumulate == 0
                with run.no_sync(model) if not boundary else torch.enable_grad():
                    loss = F.cross_entropy(model(inputs), labels)
                    run.backward(loss / args.accumulate)
                losses.append(run.reduce({"loss": (loss.item(), 1)})["loss"])
                if boundary:
                    if args.clip:
                        run.clip_grad_norm(model, args.clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

    state = run.state_dict(model)  # full weights, plain names (gathered from shards under fsdp)
    if run.is_main:
        torch.save({"weights": state, "losses": torch.tensor(losses)}, args.out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plan"]:
        with open(sys.argv[2]) as handle:
            plan = [parser.parse_args(argv) for argv in json.load(handle)]
    else:
        plan = [parser.parse_args()]
    torch.set_default_dtype(torch.float64)
    run = mg.init(seed=SEED, timeout_s=60)
    for args in plan:
        train(run, args)
