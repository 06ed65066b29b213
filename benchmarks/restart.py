"""Time from killing a worker (SIGKILL) to the first finished step after ``--max-restarts`` resumed it.

    python benchmarks/restart.py [--repeats 5] [--nproc 2]

Each repeat is a fresh 2-process job with one restart allowed, whose rank 1 kills itself at step 5; the
agent restarts every worker, the Trainer resumes from the step-5 checkpoint. Each repeat runs the job
twice, interleaved: under ``multigpu run --max-restarts 1`` and under ``torchrun --standalone
--max-restarts 1`` (the same script: ``mg.init`` reads torchrun's variables). Both start each worker as a
new interpreter. Prints the medians and ranges, and where the time goes (medians, from the restarted
rank 0 under ``multigpu run``):

- agent: noticing the death, stopping the survivor, a new rendezvous, starting the new processes;
- interpreter: the new process until the script's first line (Python's own start-up, the worker wrapper);
- import torch, import torch._dynamo: torch's own start-up (torch imports dynamo when the first
  optimizer is constructed: every script that builds one pays it);
- import multigpu, mg.init (joining the process group), building the Trainer (model, optimizer, DDP);
- resume: choosing, verifying and loading the checkpoint; first step: one training step.

Checkpoints are synchronous here (``async_checkpoint=False``), so the step-5 checkpoint exists when rank 1
dies and every repeat resumes from the same step.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from record import record

HERE = Path(__file__).resolve().parent
PHASES = [("agent", "killed_at", "process_start"), ("interpreter", "process_start", "first_line"),
          ("import torch", "first_line", "torch_imported"), ("import torch._dynamo", "torch_imported", "dynamo_imported"),
          ("import multigpu", "dynamo_imported", "multigpu_imported"),
          ("mg.init", "multigpu_imported", "init_done"), ("Trainer built", "init_done", "trainer_built"),
          ("resume", "trainer_built", "resumed"), ("first step", "resumed", "first_step")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    launchers = {
        "multigpu": [sys.executable, "-P", "-m", "multigpu", "run", "--nproc", str(args.nproc), "--max-restarts", "1"],
        "torchrun": [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone",
                     f"--nproc_per_node={args.nproc}", "--max-restarts", "1"],
    }
    gaps: dict[str, list[float]] = {name: [] for name in launchers}
    parts: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
    for index in range(args.repeats):
        for launcher in (list(launchers) if index % 2 == 0 else list(reversed(launchers))):
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([*launchers[launcher], str(HERE / "restart_worker.py"), tmp],
                               check=True, capture_output=True, text=True)
                times = json.loads(Path(tmp, "phases.json").read_text())
                times["killed_at"] = float(Path(tmp, "killed_at").read_text())
            gaps[launcher].append(times["first_step"] - times["killed_at"])
            if launcher == "multigpu":
                for name, first, last in PHASES:
                    parts[name].append(times[last] - times[first])
            print(f"repeat {index + 1} {launcher}: {gaps[launcher][-1]:.2f} s", flush=True)
    for launcher, values in gaps.items():
        print(f"\nkill -> first resumed step, {args.nproc} gloo processes, {launcher}, {args.repeats} repeats: "
              f"median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})")
    for name, values in parts.items():
        print(f"  {name:16s} {statistics.median(values):6.3f} s")
    phases = {name.replace("import ", "").replace("torch._dynamo", "dynamo").replace(".", "_").replace(" ", "_").lower() + "_s":
              statistics.median(values) for name, values in parts.items()}
    ours, theirs = gaps["multigpu"], gaps["torchrun"]
    record("restart", {"median_s": statistics.median(ours), "min_s": min(ours), "max_s": max(ours),
                       "torchrun_median_s": statistics.median(theirs), "torchrun_min_s": min(theirs),
                       "torchrun_max_s": max(theirs), "ratio": statistics.median(ours) / statistics.median(theirs),
                       "repeats": args.repeats, "nproc": args.nproc, **phases},
           [__file__, HERE / "restart_worker.py"])


if __name__ == "__main__":
    main()
