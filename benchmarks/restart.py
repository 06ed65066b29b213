"""Time from killing a worker (SIGKILL) to the first finished step after ``--max-restarts`` resumed it.

    python benchmarks/restart.py [--repeats 5] [--nproc 2]

Each repeat is a fresh ``multigpu run --nproc 2 --max-restarts 1`` job whose rank 1 kills itself at
step 5; the agent restarts every worker, the Trainer resumes from the step-5 checkpoint. Prints the
median and range, and where the time goes (medians, from the restarted rank 0):

- agent: noticing the death, stopping the survivor, a new rendezvous, starting the new processes;
- interpreter: the new process until the script's first line (Python itself);
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
    gaps, parts = [], {name: [] for name, _, _ in PHASES}
    for index in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "multigpu", "run", "--nproc", str(args.nproc), "--max-restarts", "1",
                            str(HERE / "restart_worker.py"), tmp], check=True, capture_output=True, text=True)
            times = json.loads(Path(tmp, "phases.json").read_text())
            times["killed_at"] = float(Path(tmp, "killed_at").read_text())
            gaps.append(times["first_step"] - times["killed_at"])
            for name, start, end in PHASES:
                parts[name].append(times[end] - times[start])
            print(f"repeat {index + 1}: {gaps[-1]:.2f} s", flush=True)
    print(f"\nkill -> first resumed step, {args.nproc} gloo processes, {args.repeats} repeats: "
          f"median {statistics.median(gaps):.2f} s (min {min(gaps):.2f}, max {max(gaps):.2f})")
    for name, values in parts.items():
        print(f"  {name:16s} {statistics.median(values):6.3f} s")
    phases = {name.replace("import ", "").replace("torch._dynamo", "dynamo").replace(".", "_").replace(" ", "_").lower() + "_s":
              statistics.median(values) for name, values in parts.items()}
    record("restart", {"median_s": statistics.median(gaps), "min_s": min(gaps), "max_s": max(gaps),
                       "repeats": args.repeats, "nproc": args.nproc, **phases}, [__file__, HERE / "restart_worker.py"])


if __name__ == "__main__":
    main()
