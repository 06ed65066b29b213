"""A small Trainer run for the replica-group tests (strategy ft-ddp, torchft).

    multigpu run --replica-groups 2 --max-restarts 1 replicas.py OUT_DIR [--kill-at STEP] [--sleep S] ...

Every committed step of every group appends one JSON line to OUT_DIR/steps-g<G>.jsonl (group, attempt,
step, live groups, wall time, a digest of the weights). At the end each group's rank 0 writes its final
weights to OUT_DIR/final-g<G>.pt.
--kill-at STEP       group --kill-group SIGKILLs itself in step STEP+1 (first attempt only), after its forward:
                     the quorum of that step holds it, so the others' all-reduce fails and the step is dropped
--sleep S            sleep S seconds in every step (time for the other group, or a test, to act)
--hold S             after the kill, a live group sleeps S seconds per step while it is alone
--wait-restart-at K  ... and before step K+1 it waits until the killed group's restarted process is about to
                     join (it writes OUT/restarted-g<G> just before): the restart (seconds of process start-up)
                     then always meets a live group with steps left, whatever the machine's speed
--valid              validate every epoch (metrics land in each group's metrics.csv)
--wider              build a wider model in group --kill-group (the desync guard across groups)
--rejoin-after-alone  a restarted group starts (mg.init) only once a live group has committed a step alone (a
                     restart forked from the launcher's server takes ~1 s: it could otherwise rejoin first)
--final-checkpoint-only  no checkpoint before the end: a restarted group has nothing to resume from but a
                     live peer (so it always heals)
"""

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--kill-at", type=int)
parser.add_argument("--kill-group", type=int, default=1)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--hold", type=float, default=0.0)
parser.add_argument("--wait-restart-at", type=int)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--valid", action="store_true")
parser.add_argument("--wider", action="store_true")
parser.add_argument("--final-checkpoint-only", action="store_true")
parser.add_argument("--rejoin-after-alone", action="store_true")
args = parser.parse_args()

out = Path(args.out)
if args.rejoin_after_alone and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
    # Before mg.init: a restarted group's torchft manager heartbeats from the moment it is built, and the
    # lighthouse then holds the survivor's quorum for it; before it exists, nothing waits for this group.
    # the survivor steps alone within seconds; the test's 230 s never outlived
    deadline = time.monotonic() + 60
    while not (out / "alone-seen").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
run = mg.init(seed=0, timeout_s=60)
group = run.world.replica_group


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class ReplicaTrainer(mg.Trainer):
    def compute_loss(self, batch):
        step = self.state.global_step
        if args.sleep:
            time.sleep(args.sleep)
        alone = (
            self.strategy.participants() < run.world.replica_groups
            and (out / f"killed-g{args.kill_group}").exists()
        )
        # 5x longer once the killed group is restarting: it joins while steps are left
        if alone and args.hold:
            time.sleep(args.hold * (5 if (out / f"restarted-g{args.kill_group}").exists() else 1))
        if alone and args.wait_restart_at is not None and step == args.wait_restart_at:
            while not (out / f"restarted-g{args.kill_group}").exists():
                time.sleep(0.05)
        inputs, labels = batch
        loss = F.cross_entropy(self.model(inputs), labels)
        if (
            args.kill_at is not None
            and step == args.kill_at
            and group == args.kill_group
            and run.world.restart_count == 0
        ):
            (out / f"killed-g{group}").write_text(json.dumps({"step": step, "t": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    def resume(self):
        found = super().resume()
        if run.world.restart_count > 0:  # the next thing fit does is join the live group
            (out / f"restarted-g{group}").write_text(str(os.getpid()))
        return found

    def on_train_batch_end(self, step, loss):
        if run.rank == 0:
            record = {
                "group": group,
                "attempt": run.world.restart_count,
                "pid": os.getpid(),
                "step": step,
                "t": time.time(),
                "live": self.strategy.participants(),
                "digest": digest(self.strategy.unwrap(self.model)),
                "epoch": self.state.epoch,
                "batch": self.state.batch_in_epoch,
            }
            with open(out / f"steps-g{group}.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
            if record["live"] < run.world.replica_groups:
                (out / "alone-seen").touch()


g = torch.Generator().manual_seed(5)
x = torch.randn(args.samples, 10, generator=g)
y = (x[:, :3].argmax(dim=1) + (x[:, 3] > 1).long()) % 3
train = TensorDataset(x, y)
valid = TensorDataset(x[:40], y[:40]) if args.valid else None
width = 32 if args.wider and group == args.kill_group else 24
model = nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, 3))
trainer = ReplicaTrainer(
    run,
    model,
    lambda p: torch.optim.AdamW(p, lr=0.01),
    epochs=args.epochs,
    batch_size=args.batch_size,
    checkpoint_every_steps=None if args.final_checkpoint_only else 4,
    checkpoint_every_epochs=1000 if args.final_checkpoint_only else 1,
    keep_last=2,
    out_dir=str(out / "run"),
    progress=False,
    log_every_n_steps=1,
    stop_check_every=1,
    plot=False,
)
trainer.fit(train, valid)
(out / f"digest-g{group}-r{run.rank}").write_text(digest(trainer.strategy.unwrap(trainer.model)))
if run.rank == 0:
    torch.save(trainer.strategy.unwrap(trainer.model).state_dict(), out / f"final-g{group}.pt")
    (out / f"done-g{group}").write_text(
        json.dumps(
            {"step": trainer.state.global_step, "t": time.time(), "history": trainer.history}
        )
    )
