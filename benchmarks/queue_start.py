"""A queue of short runs on CPU slots: each run's launcher forked from the queue's server (the default,
src/multigpu/launch/launchers.py) against each run a new interpreter (``MULTIGPU_WORKER_START=plain``).

    python benchmarks/queue_start.py [--repeats 5] [--runs 6] [--slots 2]

The runs: benchmarks/startup_step.py (import torch, ``mg.init``, a DDP-wrapped model, an optimizer, one
step: what a sweep's short trial does before its real work), ``--runs`` of them on ``--slots`` CPU slots,
one process each. The two ways alternate (interleaved repeats); medians of the queue's wall time and of
the CPU time of its whole process tree (the queue, its server, every run's processes) are printed and
recorded, with the ratios and the CPU per run each way saves.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import record

ROOT = Path(__file__).resolve().parents[1]
STEP = ROOT / "benchmarks" / "startup_step.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--slots", type=int, default=2)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("MULTIGPU_WORKER_START", None)
    ways = {"forked": env, "plain": {**env, "MULTIGPU_WORKER_START": "plain"}}
    wall: dict[str, list[float]] = {way: [] for way in ways}
    cpu: dict[str, list[float]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(prefix="queue-start-") as tmp:
        runs = Path(tmp) / "runs.yaml"
        runs.write_text("".join(f"trial{i}:\n  script: {STEP}\n  out_dir_key: null\n" for i in range(args.runs)))
        for index in range(args.repeats):
            for way in (list(ways) if index % 2 == 0 else list(reversed(list(ways)))):
                out = Path(tmp) / f"{way}-{index}"
                before = _children_cpu()
                started = time.perf_counter()
                subprocess.run([sys.executable, "-m", "multigpu", "queue", str(runs), "--slots", str(args.slots),
                                "--out", str(out), "--no-live"], check=True, capture_output=True, env=ways[way])
                wall[way].append(time.perf_counter() - started)
                cpu[way].append(_children_cpu() - before)
    figures: dict = {"repeats": args.repeats, "runs": args.runs, "slots": args.slots}
    for way in ways:
        figures[f"{way}_median_s"] = statistics.median(wall[way])
        figures[f"{way}_cpu_s"] = statistics.median(cpu[way])
        print(f"{way:7s} wall median {figures[f'{way}_median_s']:.2f} s (min {min(wall[way]):.2f}, "
              f"max {max(wall[way]):.2f}), CPU median {figures[f'{way}_cpu_s']:.2f} s")
    figures["wall_ratio"] = figures["forked_median_s"] / figures["plain_median_s"]
    figures["cpu_ratio"] = figures["forked_cpu_s"] / figures["plain_cpu_s"]
    figures["cpu_saved_per_run_s"] = (figures["plain_cpu_s"] - figures["forked_cpu_s"]) / args.runs
    print(f"forked/plain: wall {figures['wall_ratio']:.3f}, CPU {figures['cpu_ratio']:.3f}; "
          f"CPU saved per run {figures['cpu_saved_per_run_s']:.2f} s")
    record("queue_start", figures, [__file__, STEP])


def _children_cpu() -> float:
    """User and system CPU seconds of every process this one has waited for, with their own waited-for
    children: the queue, its server, every run's boot process, launcher and workers."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
