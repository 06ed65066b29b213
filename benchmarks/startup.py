"""Start-up to exit: ``multigpu run`` against ``torchrun --standalone`` for the same 2-process script.

    python benchmarks/startup.py [--repeats 7] [--nproc 2]

Both launch tests/scripts/allreduce.py (mg.init, one all_reduce, teardown); runs are interleaved;
medians and their ratio are printed.
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from record import record

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    script = str(ROOT / "tests" / "scripts" / "allreduce.py")
    commands = {
        "multigpu run": [sys.executable, "-m", "multigpu", "run", "--nproc", str(args.nproc), script],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", script],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for index in range(args.repeats):
        order = list(commands.items()) if index % 2 == 0 else list(reversed(commands.items()))
        for name, command in order:
            started = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            times[name].append(time.perf_counter() - started)
    for name, values in times.items():
        print(f"{name:13s} median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})")
    ratio = statistics.median(times['multigpu run']) / statistics.median(times['torchrun'])
    print(f"ratio multigpu/torchrun {ratio:.3f}")
    figures = {"ratio": ratio, "repeats": args.repeats, "nproc": args.nproc}
    for key, name in (("multigpu", "multigpu run"), ("torchrun", "torchrun")):
        figures.update({f"{key}_median_s": statistics.median(times[name]), f"{key}_min_s": min(times[name]),
                        f"{key}_max_s": max(times[name])})
    record("startup", figures, [__file__, ROOT / "tests" / "scripts" / "allreduce.py"])


if __name__ == "__main__":
    main()
