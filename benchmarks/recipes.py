"""The recipes' own figures: the `make demo` job (digits, 2 CPU processes) and the digits runs file as a queue.

    python benchmarks/recipes.py [--skip-queue]

Runs, from a temporary folder (nothing is written into the repository):
- ``multigpu run --nproc 2 examples/digits/train.py examples/digits/hparams.yaml`` (what `make demo` runs):
  wall time from launch to exit, and the final validation accuracy from its final.json;
- ``multigpu queue examples/digits/runs.yaml``: the makespan, the summed run time and the share of the
  ideal (summed time / slots), from the queue's own summary line.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import record

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-queue", action="store_true")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(ROOT / "examples", Path(tmp) / "examples")
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "multigpu", "run", "--nproc", "2", "examples/digits/train.py",
                        "examples/digits/hparams.yaml"], check=True, cwd=tmp, env=env, capture_output=True)
        figures["demo_s"] = time.perf_counter() - started
        final = json.loads((Path(tmp) / "outputs" / "digits" / "final.json").read_text())
        figures["demo_accuracy_pct"] = 100 * final["accuracy"]
        print(f"demo: {figures['demo_s']:.1f} s, validation accuracy {figures['demo_accuracy_pct']:.1f}%")
        if not args.skip_queue:
            out = subprocess.run([sys.executable, "-m", "multigpu", "queue", "examples/digits/runs.yaml"], check=True,
                                 cwd=tmp, env=env, capture_output=True, text=True).stdout
            found = re.search(r"makespan ([\d.]+) s for ([\d.]+) s of runs on (\d+) slot\(s\) \(ideal ([\d.]+) s, (\d+)%",
                              out)
            assert found, out
            span, work, slots, ideal, share = found.groups()
            figures.update(queue_makespan_s=float(span), queue_work_s=float(work), queue_slots=int(slots),
                           queue_ideal_s=float(ideal), queue_ideal_pct=int(share),
                           queue_runs=len(re.findall(r"^\[queue\] done ", out, re.M)))
            print(out[-600:])
    record("recipes", figures, [__file__, ROOT / "examples" / "digits" / "train.py",
                                ROOT / "examples" / "digits" / "hparams.yaml", ROOT / "examples" / "digits" / "runs.yaml"])


if __name__ == "__main__":
    main()
