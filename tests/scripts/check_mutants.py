"""A small training script with one planted bug at a time, for `multigpu check` (tests/test_check.py).

    multigpu check --nproc 2 --steps 3 check_mutants.py [--bug NAME]       # one case, as a user runs it
    multigpu run --nproc 2 check_mutants.py --table a,b,c --records DIR --steps 3 --scale 1
    multigpu run --nproc 1 check_mutants.py --table a,b,c --records DIR --steps 3 --scale 2

The second form runs several cases in one launch, one after the other, each recorded into DIR/<case>
by the same recorder `multigpu check` gives a script (multigpu.guards.probe.Probe, set as
``run.probe`` as mg.init does when the check starts it); the test then compares DIR of the
2-process launch with DIR of the 1-process launch case by case with the check's own report. One
launch per run instead of two per case keeps the mutation table to seconds.

Each bug is one that real programs have (see BUGS); CORRECT lists the variants that must be EQUAL.
The model is a 6-16-3 MLP with dropout (switched off by the check), the data 128 random samples.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import multigpu as mg

BUGS = {
    "get_batch_one_seed": "nanoGPT's get_batch: random offsets drawn after torch.manual_seed(1337) on every rank",
    "accum_div_world": "gradient accumulation divided by the world size (gradient_accumulation_steps //= world_size)",
    "batch_div_world": "batch per process = global batch // world size",
    "sum_loss": "a loss summed over the batch (reduction='sum')",
    "loss_div_world": "a loss divided by the world size (as if DDP summed gradients)",
    "grad_sum": "an all-reduce SUM of the gradients on top of DDP's average",
    "rank0_step": "optimizer.step() inside `if rank == 0`",
    "batchnorm": "BatchNorm without SyncBatchNorm",
    "mean_of_means": "a validation metric averaged over the ranks' means on uneven shards",
    "plain_loader": "a plain DataLoader beside an unused run.loader",
    "clip_before_unscale": "gradient clipping before scaler.unscale_ (GradScaler)",
    "scheduler_per_micro": "an LR scheduler stepped on every micro-step",
    "dropout_one_generator": "dropout drawing from one seed on every rank (torch.manual_seed(1337) after setup)",
    "noise_same_seed": "a noise augmentation seeded alike on every rank",
    "no_sync_always": "run.no_sync around every micro-step, the last included",
    "sync_toggle_wrong": "nanoGPT's require_backward_grad_sync toggle on the first micro-step, not the last",
    "late_layer": "a layer built after run.setup, outside the model, in the optimizer",
    "bypass_wrapper": "the forward called on model.module (around DDP)",
    "unused": "a parameter outside the forward (no gradient)",
    "drop_last_padding": "a dataset that does not divide evenly: the sampler pads the last batch",
}
CORRECT = [
    "none",
    "late_optimizer",
    "seq_first",
    "plain_backward",
    "accumulate",
    "nanogpt_toggle",
    "amp_clip",
    "scheduler_per_step",
    "trainer",
]
#: Right for training, but not what the check can compare: no tensor reaches the forward; batches made
#: by hand with a generator per rank (the check cannot give its one-process run N times the batch).
UNCHECKABLE = ["opaque_inputs", "per_rank_generator"]
#: Trains nothing, so agrees on any number of processes (a loss that is always 0, a learning rate of 0), or
#: diverged in both runs (NaN against NaN).
STILL = ["zero_loss", "zero_lr", "nan_loss"]
ACCUMULATING = {
    "accumulate",
    "nanogpt_toggle",
    "scheduler_per_micro",
    "scheduler_per_step",
    "no_sync_always",
    "sync_toggle_wrong",
    "accum_div_world",
}


class Box:
    """A batch the model unpacks itself: no tensor reaches the forward as an argument."""

    def __init__(self, x):
        self.x = x


class Net(nn.Module):
    def __init__(self, batchnorm: bool = False, spare: bool = False):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(6, 16),
            nn.BatchNorm1d(16) if batchnorm else nn.Identity(),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(16, 3),
        )
        self.spare = nn.Linear(3, 3) if spare else None

    def forward(self, x):
        if isinstance(x, Box):
            x = x.x
        return self.body(x)


def datasets(bug: str):
    g = torch.Generator().manual_seed(1)
    # 37 on 2 ranks: 19 each, one padded; batch 8 -> 8, 8, 3
    n = 37 if bug == "drop_last_padding" else 128
    train = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    valid = TensorDataset(torch.randn(13, 6, generator=g), torch.randint(0, 3, (13,), generator=g))
    return train, valid


def batches(run, bug: str, train: Dataset):
    """The batches of this rank, forever, from the source the bug calls for."""
    # nanoGPT: torch.randint(len(data) - block_size, ...)
    if bug in ("get_batch_one_seed", "per_rank_generator"):
        x, y = train.tensors
        g = torch.Generator().manual_seed(1337 + run.rank) if bug == "per_rank_generator" else None
        while True:
            ix = torch.randint(len(x), (8,), generator=g)
            yield x[ix], y[ix]
    batch = 16 // run.world_size if bug == "batch_div_world" else 8
    if bug == "plain_loader":
        run.loader(train, batch, quiet=True)  # built, and then not used
        loader = DataLoader(train, batch_size=batch, shuffle=False)
    else:
        loader = run.loader(train, batch, quiet=True, shuffle=bug != "drop_last_padding")
    while True:
        yield from loader


def train_with_trainer(run, bug: str) -> None:
    class Fit(mg.Trainer):
        def compute_loss(self, batch):
            inputs, labels = batch
            return F.cross_entropy(self.model(inputs), labels)

    data, _ = datasets(bug)
    Fit(
        run,
        Net(),
        lambda p: torch.optim.SGD(p, lr=0.1),
        batch_size=8,
        epochs=3,
        accumulate=2,
        progress=False,
        plot=False,
        out_dir="unused-by-check",
    ).fit(data)


def train(run, bug: str) -> None:
    """One training run with the planted bug; the check's probe stops it after K optimizer steps."""
    if bug == "trainer":
        return train_with_trainer(run, bug)
    data, valid = datasets(bug)
    model = Net(batchnorm=bug == "batchnorm", spare=bug == "unused")
    # the optimizer built after run.setup, from the wrapped model's parameters
    if bug == "late_optimizer":
        model, _ = run.setup(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model, optimizer = run.setup(
            model, lambda p: torch.optim.SGD(p, lr=0.0 if bug == "zero_lr" else 0.1)
        )
    head = None
    # built after run.setup: each rank's own initial weights, never averaged
    if bug == "late_layer":
        head = nn.Linear(3, 3)
        optimizer.add_param_group({"params": head.parameters()})
    accumulate = (
        (2 // run.world_size if bug == "accum_div_world" else 2) if bug in ACCUMULATING else 1
    )
    scaler = (
        torch.amp.GradScaler("cpu")
        if bug in ("clip_before_unscale", "amp_clip", "nanogpt_toggle")
        else None
    )
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
        if bug in ("scheduler_per_micro", "scheduler_per_step", "nanogpt_toggle")
        else None
    )
    source = batches(run, bug, data)
    if bug in ("noise_same_seed", "dropout_one_generator", "get_batch_one_seed"):
        torch.manual_seed(1337)  # after mg.init and run.setup: the same stream on every rank
    step = 0
    while True:
        for micro in range(accumulate):
            inputs, labels = next(source)
            if bug == "noise_same_seed":
                inputs = inputs + 0.1 * torch.randn_like(inputs)
            last = micro == accumulate - 1
            if bug in ("nanogpt_toggle", "sync_toggle_wrong") and hasattr(
                model, "require_backward_grad_sync"
            ):
                model.require_backward_grad_sync = last if bug == "nanogpt_toggle" else micro == 0
            if bug == "no_sync_always" or (
                bug in ACCUMULATING and not last and "toggle" not in bug
            ):
                sync = run.no_sync(model)
            else:
                sync = contextlib.nullcontext()
            with sync:
                # (time=1, batch, features): the input's first dimension is not the batch
                if bug == "seq_first":
                    logits = model(inputs.unsqueeze(0)).squeeze(0)
                elif bug == "bypass_wrapper":
                    logits = run.unwrap(model)(inputs)
                elif bug == "opaque_inputs":
                    logits = model(Box(inputs))
                else:
                    logits = model(inputs)
                if head is not None:
                    logits = head(logits)
                loss = F.cross_entropy(
                    logits, labels, reduction="sum" if bug == "sum_loss" else "mean"
                )
                if bug == "loss_div_world":
                    loss = loss / run.world_size
                # the PyTorch DDP tutorial's toy shape: a loss that is always 0
                if bug == "zero_loss":
                    loss = loss * 0
                # a diverged run: NaN in both, which proves nothing either way
                if bug == "nan_loss":
                    loss = loss * float("nan")
                loss = loss / accumulate
                if scaler is not None:
                    scaler.scale(loss).backward()
                elif bug == "plain_backward":
                    loss.backward()
                else:
                    run.backward(loss)
            if bug == "scheduler_per_micro":
                scheduler.step()
        # (one process: no group, as users guard it)
        if bug == "grad_sum" and dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)  # SUM on top of DDP's average: N x the gradient
        if bug == "mean_of_means" and step == 1:
            evaluate_mean_of_means(run, model, valid)
        if scaler is not None:
            if bug != "clip_before_unscale":
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
        elif bug != "rank0_step" or run.rank == 0:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None and bug != "scheduler_per_micro":
            scheduler.step()
        step += 1


def evaluate_mean_of_means(run, model, valid) -> None:
    model.eval()
    with torch.no_grad():
        correct = total = 0
        for x, y in run.eval_loader(valid, batch_size=16):
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
        accuracy = torch.tensor([correct / total])
        if dist.is_initialized():
            dist.all_reduce(accuracy, op=dist.ReduceOp.AVG)
    model.train()


def run_table(run, cases: list[str], records: Path, steps: int, scale: int) -> None:
    """Each case in turn with its own recorder, as `multigpu check` would record it in its own launch."""
    from multigpu.checkpoint.rng import seed_everything
    from multigpu.guards.probe import NO_PROBE, CheckDone, Probe

    for case in cases:
        folder = records / case
        probe = Probe(folder, run.rank, steps=steps, scale=scale)
        run.probe = probe
        seed_everything(0)  # what mg.init(seed=0) did before the script built its model
        status, error = 0, ""
        try:
            train(run, case)
        except CheckDone:
            pass
        # recorded like a failed run; the next case goes on (the failure is on every rank)
        except Exception as exc:
            status, error = 1, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        finally:
            probe.close()
            run.probe = NO_PROBE
            # the Trainer marks any exception out of fit, the planned stop included
            run.guards.interrupted_by = None
        (folder / f"status.rank{run.rank}.json").write_text(
            json.dumps({"status": status, "error": error})
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", default="none", choices=[*BUGS, *CORRECT, *UNCHECKABLE, *STILL])
    parser.add_argument(
        "--table", help="comma-separated cases, each recorded into --records/<case>"
    )
    parser.add_argument("--records", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1)
    args, _token = parser.parse_known_args()  # a test may append a token to find leftover processes
    run = mg.init(seed=0, timeout_s=60)
    if args.table:
        run_table(run, args.table.split(","), args.records, args.steps, args.scale)
    else:
        run.print(f"check_mutants: training with bug {args.bug!r} on {run.world_size} process(es)")
        train(run, args.bug)
    return 0


if __name__ == "__main__":
    sys.exit(main())
