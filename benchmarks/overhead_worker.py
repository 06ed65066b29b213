"""One timed run for benchmarks/overhead.py: the Trainer or a hand-written DDP loop, same model and data.

    multigpu run --nproc 2 benchmarks/overhead_worker.py --impl trainer|manual --out result.json
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("--impl", choices=["trainer", "manual"], required=True)
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--out", required=True)
args = parser.parse_args()


def make_model():
    return nn.Sequential(nn.Linear(128, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                         nn.Linear(args.width, 10))


def dataset(world):
    g = torch.Generator().manual_seed(0)
    n = args.steps * args.batch * world
    return TensorDataset(torch.randn(n, 128, generator=g), torch.randint(0, 10, (n,), generator=g))


epoch_seconds = []
if args.impl == "trainer":
    run = mg.init(seed=0)

    class Bench(mg.Trainer):
        def compute_loss(self, batch):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

    trainer = Bench(run, make_model(), lambda p: torch.optim.SGD(p, lr=0.01), batch_size=args.batch, epochs=3,
                    resume=False, progress=False, checkpoint_every_epochs=1000, out_dir=args.out + ".run")
    trainer.save = lambda: None  # time the training loop, not the final checkpoint
    history = trainer.fit(dataset(run.world_size))
    epoch_seconds = [row["epoch_s"] for row in history]
    rank, world = run.rank, run.world_size
else:  # the PyTorch DDP tutorial's loop
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = dataset(world)
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        started = time.monotonic()
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        epoch_seconds.append(time.monotonic() - started)
    dist.barrier()
    dist.destroy_process_group()

if rank == 0:
    with open(args.out, "w") as handle:
        json.dump({"impl": args.impl, "step_s": [s / args.steps for s in epoch_seconds[1:]]}, handle)
