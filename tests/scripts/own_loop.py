"""A hand-written loop (the Fabric/Accelerate style) with the same safety as the Trainer.

    multigpu run --nproc 2 own_loop.py OUT [--sleep S] [--hang-at STEP] [--steps N] [--desync] [--check-every K]
                                       [--hold-at STEP] [--snapshot-at STEP]

Each step: run.step_done(step) (watchdog heartbeat), run.should_stop() (the preemption agreement);
before training: run.check_consistency(model, config). Checkpoints every step; resumes by itself.
Writes OUT/final.pt (rank 0) and OUT/stopped-rank<r>.txt with the step each rank stopped at.
--hold-at: every rank waits after that step until a stop signal arrives (hold.py); --snapshot-at: the
weights after that step in OUT/step<N>.pt too (a longer run is a reference for a shorter one: the loop
does not depend on the number of steps).
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hold import hold, released
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--hang-at", type=int)
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--desync", action="store_true")
parser.add_argument("--check-every", type=int)
parser.add_argument("--hold-at", type=int)
parser.add_argument("--snapshot-at", type=int)
args, _unknown = parser.parse_known_args()  # a test may append a token to find leftover processes
out = Path(args.out)

run = mg.init(seed=0, timeout_s=60)
# 4 s only where a test plants a hang: a run that should finish gets 300 s, so a step that a busy machine
# stalls for seconds (a checkpoint's fsync, a starved core) is never reported as a hang.
run.configure_guards(
    hang_timeout_s=4.0 if args.hang_at is not None else 300.0,
    report_dir=str(out / "hang"),
    hang_notice_s=2.0 if args.hang_at is not None else 60.0,
    stop_check_every=args.check_every,
)
g = torch.Generator().manual_seed(2)
data = TensorDataset(torch.randn(192, 8, generator=g), torch.randint(0, 4, (192,), generator=g))
width = 32 if (args.desync and run.rank == 1) else 16
model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 4))
run.check_consistency(model, config={"lr": 0.05, "steps": args.steps})
model, optimizer = run.setup(model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
loader = run.loader(data, batch_size=8, quiet=True)
state = run.load_checkpoint(out / "checkpoints", model, optimizer) or {
    "step": 0,
    "position": [0, 0],
}
step = state["step"]
loader.resume_at(*state["position"])
while step < args.steps:
    for inputs, labels in loader:
        if args.hang_at is not None and step == args.hang_at and run.rank == 1:
            # a rank stuck (a dead filesystem, a deadlock): the watchdog must report it
            time.sleep(3600)
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        run.backward(loss)
        optimizer.step()
        step += 1
        time.sleep(args.sleep)
        run.step_done(step)
        path = None
        if step % 1 == 0:
            # loader.position(), not loader.epoch: at an epoch's last batch the next pass is the next epoch
            path = run.save_checkpoint(
                out / "checkpoints",
                step,
                {
                    "model": model,
                    "optimizer": optimizer,
                    "step": step,
                    "position": list(loader.position()),
                },
                keep_last=3,
            )
        if step == args.snapshot_at:
            snapshot = run.state_dict(model)
            if run.is_main:
                torch.save(snapshot, out / f"step{step}.pt")
        if step == args.hold_at and not released(out):
            hold(out, run)
        if run.should_stop():
            (out / f"stopped-rank{run.rank}.txt").write_text(str(step))
            run.exit_preempted(path, step)
        if step >= args.steps:
            break
weights = run.state_dict(model)
if run.is_main:
    torch.save(weights, out / "final.pt")
    print(f"done step {step}", flush=True)
