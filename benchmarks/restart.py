"""Time from killing a worker (SIGKILL) to the first finished step after ``--max-restarts`` resumed it.

    python benchmarks/restart.py [--repeats 5] [--nproc 2]

Each repeat is a fresh ``multigpu run --nproc 2 --max-restarts 1`` job whose rank 1 kills itself at
step 5; the agent restarts every worker, the Trainer resumes from the step-5 checkpoint. Each repeat runs
the job twice, interleaved: workers forked from the launcher's fork server (the default on CPU) and
the plain start (``MULTIGPU_WORKER_START=plain``: a new interpreter per worker, as torchrun starts them).
Prints the medians and ranges, and where the time goes (medians, from the restarted rank 0 of the
default start):

- agent: noticing the death, stopping the survivor, a new rendezvous, starting the new processes (a
  small boot process per rank, and the fork);
- interpreter: the new process until the script's first line (the worker wrapper; with the plain start
  Python's own start-up too);
- import torch, import torch._dynamo: torch's own start-up (torch imports dynamo when the first
  optimizer is constructed: every script that builds one pays it; a forked worker has both already);
- import multigpu, mg.init (joining the process group), building the Trainer (model, optimizer, DDP);
- resume: choosing, verifying and loading the checkpoint; first step: one training step.

Checkpoints are synchronous here (``async_checkpoint=False``), so the step-5 checkpoint exists when rank 1
dies and every repeat resumes from the same step.
"""

import argparse
import json
import os
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
    gaps: dict[str, list[float]] = {"fork": [], "plain": []}
    parts: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
    for index in range(args.repeats):
        for start in (("fork", "plain") if index % 2 == 0 else ("plain", "fork")):
            env = {**os.environ, "MULTIGPU_WORKER_START": start}
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([sys.executable, "-m", "multigpu", "run", "--nproc", str(args.nproc),
                                "--max-restarts", "1", str(HERE / "restart_worker.py"), tmp],
                               check=True, capture_output=True, text=True, env=env)
                times = json.loads(Path(tmp, "phases.json").read_text())
                times["killed_at"] = float(Path(tmp, "killed_at").read_text())
            gaps[start].append(times["first_step"] - times["killed_at"])
            if start == "fork":
                for name, first, last in PHASES:
                    parts[name].append(times[last] - times[first])
            print(f"repeat {index + 1} {start}: {gaps[start][-1]:.2f} s", flush=True)
    for start, values in gaps.items():
        print(f"\nkill -> first resumed step, {args.nproc} gloo processes, {start} start, {args.repeats} repeats: "
              f"median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})")
    for name, values in parts.items():
        print(f"  {name:16s} {statistics.median(values):6.3f} s")
    phases = {name.replace("import ", "").replace("torch._dynamo", "dynamo").replace(".", "_").replace(" ", "_").lower() + "_s":
              statistics.median(values) for name, values in parts.items()}
    fork, plain = gaps["fork"], gaps["plain"]
    record("restart", {"median_s": statistics.median(fork), "min_s": min(fork), "max_s": max(fork),
                       "plain_median_s": statistics.median(plain), "plain_min_s": min(plain),
                       "plain_max_s": max(plain), "repeats": args.repeats, "nproc": args.nproc, **phases},
           [__file__, HERE / "restart_worker.py"])

if __name__ == "__main__":
    main()
