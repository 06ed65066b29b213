"""One benchmark job of benchmarks/peers.py, run under torchrun: the same MLP training written for each library.

    torchrun --standalone --nproc-per-node 2 benchmarks/peers_worker.py --job ddp --width 128 --batch 32 --out r.json

Every job trains the same 3-layer MLP on the same synthetic data with SGD, shuffled by a distributed
sampler, for ``--epochs`` epochs of ``--steps`` optimizer steps. The clock is inside the model: a
forward pre-hook records when each training forward starts, so every job is timed the same way,
whatever its library does around the step. Rank 0 writes the gaps between consecutive forwards after
the first epoch (warm-up) to ``--out``. Each job is written the way that library's own guide writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

JOBS = ("ddp", "trainer", "own_loop", "fabric", "accelerate", "lightning")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=JOBS, required=True)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="per process")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per epoch")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--out-dir", default="trainer-out", help="the Trainer's out_dir (fresh for every run)")
    return parser.parse_args()


def build(args: argparse.Namespace, world: int) -> tuple[nn.Module, TensorDataset, list[float]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 10))
    stamps: list[float] = []
    model.register_forward_pre_hook(lambda module, inputs: stamps.append(time.perf_counter()))
    g = torch.Generator().manual_seed(1)
    n = args.steps * args.batch * world
    data = TensorDataset(torch.randn(n, args.width, generator=g), torch.randint(0, 10, (n,), generator=g))
    return model, data, stamps


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def loss_of(model, batch):
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


# ------------------------------------------------------------------------------------------ jobs
def job_ddp(args):
    """The PyTorch DDP tutorial's loop: DistributedSampler + DataLoader + DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    model, data, stamps = build(args, dist.get_world_size())
    model = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = sgd(model.parameters())
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank, stamps


def job_trainer(args):
    """mg.Trainer with its defaults: preemption agreement, hang watchdog, progress, consistency check,
    a checkpoint per epoch."""
    import multigpu as mg

    class Fit(mg.Trainer):
        def compute_loss(self, batch):
            return loss_of(self.model, batch)

    run = mg.init()
    model, data, stamps = build(args, run.world_size)
    Fit(run, model, sgd, batch_size=args.batch, epochs=args.epochs, out_dir=args.out_dir).fit(data)
    return run.rank, stamps


def job_own_loop(args):
    """A loop written with the helpers: run.setup / run.loader / run.backward, with the same safety as the
    Trainer (consistency check, watchdog heartbeat, preemption agreement)."""
    import multigpu as mg

    run = mg.init()
    model, data, stamps = build(args, run.world_size)
    run.check_consistency(model)
    model, optimizer = run.setup(model, sgd)
    loader = run.loader(data, batch_size=args.batch, quiet=True)
    step = 0
    for _epoch in range(args.epochs):
        for batch in loader:
            loss = loss_of(model, batch)
            optimizer.zero_grad(set_to_none=True)
            run.backward(loss)
            optimizer.step()
            step += 1
            run.step_done(step)
            if run.should_stop():
                run.exit_preempted()
    return run.rank, stamps


def job_fabric(args):
    """Lightning Fabric's guide: Fabric(...).launch(), setup, setup_dataloaders, fabric.backward."""
    import lightning as L

    fabric = L.Fabric(accelerator="auto", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp")
    fabric.launch()
    model, data, stamps = build(args, fabric.world_size)
    model, optimizer = fabric.setup(model, sgd(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch, shuffle=True))
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            loss = loss_of(model, batch)
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
    return fabric.global_rank, stamps


def job_accelerate(args):
    """Hugging Face Accelerate's quick tour: Accelerator(), prepare, accelerator.backward."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # without cpu=True it runs undistributed on CPU
    model, data, stamps = build(args, accelerator.num_processes)
    optimizer = sgd(model.parameters())
    loader = DataLoader(data, batch_size=args.batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            loss = loss_of(model, batch)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
    return accelerator.process_index, stamps


def job_lightning(args):
    """The Lightning Trainer with a LightningModule, logger/progress bar/checkpointing/summary off
    (generous to it: our Trainer keeps all of its defaults on)."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return loss_of(self.net, batch)

        def configure_optimizers(self):
            return sgd(self.parameters())

    model, data, stamps = build(args, int(os.environ["WORLD_SIZE"]))
    trainer = L.Trainer(accelerator="auto", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp",
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Module(model), DataLoader(data, batch_size=args.batch, shuffle=True))
    return trainer.global_rank, stamps


def main() -> None:
    args = parse()
    rank, stamps = globals()[f"job_{args.job}"](args)
    world = int(os.environ["WORLD_SIZE"])
    if len(stamps) != args.epochs * args.steps:  # each rank must see 1/world of the data: truly distributed
        raise SystemExit(f"{args.job}: {len(stamps)} forwards on rank {rank}, expected {args.epochs * args.steps} "
                         f"(world {world}): the job did not shard the data")
    if rank == 0:
        kept = stamps[args.steps:]  # the first epoch warms up (allocations, buckets, first connections)
        gaps = [b - a for a, b in zip(kept, kept[1:])]
        with open(args.out, "w") as handle:
            json.dump({"job": args.job, "forwards": len(stamps), "gaps": gaps}, handle)


if __name__ == "__main__":
    main()
