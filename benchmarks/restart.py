"""Time from killing a worker (SIGKILL) to the first finished step after ``--max-restarts`` resumed it.

    python benchmarks/restart.py [--repeats 5] [--nproc 2]

Each repeat is a fresh ``multigpu run --nproc 2 --max-restarts 1`` job whose rank 1 kills itself at
step 5; the agent restarts every worker, the Trainer resumes from the step-5 checkpoint. Prints the
median and range. The gap includes: the agent noticing the death (monitor interval 0.1 s), stopping
the survivors, a new rendezvous, starting Python + torch in every worker, and loading the checkpoint.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from record import record

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    gaps = []
    for index in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "multigpu", "run", "--nproc", str(args.nproc), "--max-restarts", "1",
                            str(HERE / "restart_worker.py"), tmp], check=True, capture_output=True, text=True)
            killed = float(Path(tmp, "killed_at").read_text())
            resumed = float(Path(tmp, "resumed_at").read_text())
            gaps.append(resumed - killed)
            print(f"repeat {index + 1}: {gaps[-1]:.2f} s", flush=True)
    print(f"\nkill -> first resumed step, {args.nproc} gloo processes, {args.repeats} repeats: "
          f"median {statistics.median(gaps):.2f} s (min {min(gaps):.2f}, max {max(gaps):.2f})")
    record("restart", {"median_s": statistics.median(gaps), "min_s": min(gaps), "max_s": max(gaps),
                       "repeats": args.repeats, "nproc": args.nproc}, [__file__, HERE / "restart_worker.py"])


if __name__ == "__main__":
    main()
