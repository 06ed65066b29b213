"""Start-up to exit: ``multigpu run`` against ``torchrun --standalone`` for the same 2-process script.

    python benchmarks/startup.py [--repeats 7] [--nproc 2]

Two scripts: tests/scripts/allreduce.py (mg.init, one all_reduce, teardown) and
benchmarks/startup_step.py (mg.init, a DDP model, an optimizer, one training step - what every training
script does first). Two launchers, each worker a new interpreter under torch's elastic agent: ``multigpu
run`` and ``torchrun``. Runs are interleaved; medians and ratios are printed, and the CPU time of each
launch's whole process tree (what a busy machine, or the test suite, pays).
"""

import argparse
import resource
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
    scripts = {"allreduce": str(ROOT / "tests" / "scripts" / "allreduce.py"),
               "step": str(ROOT / "benchmarks" / "startup_step.py")}
    launchers = {
        "multigpu": lambda script: [sys.executable, "-P", "-m", "multigpu", "run", "--nproc", str(args.nproc), script],
        "torchrun": lambda script: [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc_per_node={args.nproc}", script],
    }
    cases = [(job, launcher) for job in scripts for launcher in launchers]
    times: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    cpu: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    for index in range(args.repeats):
        for job, launcher in (cases if index % 2 == 0 else list(reversed(cases))):
            before = _children_cpu()
            started = time.perf_counter()
            subprocess.run(launchers[launcher](scripts[job]), check=True, capture_output=True)
            times[(job, launcher)].append(time.perf_counter() - started)
            cpu[(job, launcher)].append(_children_cpu() - before)
    figures: dict = {"repeats": args.repeats, "nproc": args.nproc}
    for (job, launcher), values in times.items():
        used = statistics.median(cpu[(job, launcher)])
        print(f"{job:9s} {launcher:15s} median {statistics.median(values):.2f} s "
              f"(min {min(values):.2f}, max {max(values):.2f}), CPU {used:.2f} s")
        prefix = f"{launcher}_" if job == "allreduce" else f"{job}_{launcher}_"
        figures.update({f"{prefix}median_s": statistics.median(values), f"{prefix}min_s": min(values),
                        f"{prefix}max_s": max(values), f"{prefix}cpu_s": used})
    for job in scripts:
        prefix = "" if job == "allreduce" else f"{job}_"
        torchrun = statistics.median(times[(job, "torchrun")])
        figures[f"{prefix}ratio"] = statistics.median(times[(job, "multigpu")]) / torchrun
        figures[f"{prefix}cpu_ratio"] = (statistics.median(cpu[(job, "multigpu")])
                                         / statistics.median(cpu[(job, "torchrun")]))
        print(f"{job}: multigpu/torchrun wall {figures[prefix + 'ratio']:.3f}, CPU {figures[prefix + 'cpu_ratio']:.3f}")
    record("startup", figures, [__file__, ROOT / "tests" / "scripts" / "allreduce.py",
                                ROOT / "benchmarks" / "startup_step.py"])


def _children_cpu() -> float:
    """User and system CPU seconds of every process this one has waited for, with their own waited-for
    children (the launcher, the workers): the whole tree of a finished launch."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
