"""Per-step overhead of multigpu against plain DDP, Lightning (Trainer and Fabric) and Accelerate.

    python benchmarks/peers.py                      # both model sizes, 5 interleaved repeats, 2 processes
    python benchmarks/peers.py --sizes tiny --repeats 3 --jobs ddp,trainer,own_loop
    python benchmarks/peers.py --scaling            # steps/s at 1, 2, 4 processes, fixed global batch

The same job (benchmarks/peers_worker.py: a 3-layer MLP, SGD, shuffled distributed sampling) is
written for each library and started the same way, under torchrun. Time is taken inside the model
(the gap between consecutive training forwards, after a warm-up epoch), so whatever a library does
around the step counts. Jobs run interleaved - every repeat runs every job once, in a rotated order -
so the machine's drift hits all of them alike; the table shows medians over repeats (each repeat's
value is the median gap of its run), the min-max over repeats, and ratios to plain DDP.

Lightning and Accelerate are optional (``pip install -e '.[bench]'``): a job whose library is missing
is skipped with a note. Where GPUs are visible the jobs use them with NCCL.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from record import record

HERE = Path(__file__).resolve().parent
WORKER = HERE / "peers_worker.py"
JOBS = ("ddp", "trainer", "own_loop", "fabric", "accelerate", "lightning")
LABELS = {"ddp": "hand-written DDP loop", "trainer": "multigpu Trainer (defaults)",
          "own_loop": "multigpu own loop (run.setup/loader/backward)", "fabric": "Lightning Fabric",
          "accelerate": "Accelerate", "lightning": "Lightning Trainer"}
NEEDS = {"fabric": "lightning", "lightning": "lightning", "accelerate": "accelerate"}
SIZES = {"tiny": (128, 32), "wide": (1024, 64)}  # width, per-process batch
#: Runs that exited non-zero, per job (see ``one``).
EXIT_FAILURES: dict[str, int] = {}


def installed(job: str) -> bool:
    package = NEEDS.get(job)
    if package is None:
        return True
    try:
        metadata.version(package)
        return True
    except metadata.PackageNotFoundError:
        return False


def one(job: str, nproc: int, width: int, batch: int, steps: int, epochs: int, folder: Path) -> float:
    """Median seconds between consecutive training forwards of one run of ``job``."""
    out = folder / f"{job}.json"
    out.unlink(missing_ok=True)
    shutil.rmtree(folder / "trainer-out", ignore_errors=True)  # a fresh run, not a resume of the last one
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(WORKER), "--job", job, "--width", str(width), "--batch", str(batch), "--steps", str(steps),
               "--epochs", str(epochs), "--out", str(out)]
    for _attempt in range(3):
        done = subprocess.run(command, capture_output=True, text=True, cwd=folder, timeout=900,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if done.returncode != 0:
            # A rank that dies at shutdown (gloo's abort when a process group is not destroyed) after
            # the timed epochs: its numbers are complete when rank 0 wrote them; counted and reported.
            EXIT_FAILURES[job] = EXIT_FAILURES.get(job, 0) + 1
        if out.exists():
            return statistics.median(json.loads(out.read_text())["gaps"])
    tail = "\n".join(done.stderr.strip().splitlines()[-15:])
    raise SystemExit(f"{job} failed 3 times (status {done.returncode}):\n{tail}")


def versions() -> str:
    found = []
    for package in ("torch", "multigpu", "lightning", "accelerate"):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, NCCL"
    except ImportError:
        pass
    return f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), gloo"


def compare(args: argparse.Namespace) -> None:
    jobs = [j for j in args.jobs.split(",") if j]
    missing = [j for j in jobs if not installed(j)]
    for job in missing:
        print(f"note: skipping {job}: {NEEDS[job]} is not installed (pip install -e '.[bench]')")
    jobs = [j for j in jobs if j not in missing]
    sizes = [s for s in args.sizes.split(",") if s]
    results = {(size, job): [] for size in sizes for job in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for size in sizes:
                width, batch = SIZES[size]
                shift = repeat % len(jobs)
                for job in jobs[shift:] + jobs[:shift]:
                    results[size, job].append(one(job, args.nproc, width, batch, args.steps, args.epochs, Path(tmp)))
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    print(f"\n{datetime.date.today()}, {versions()}; {machine()}; {args.nproc} processes under torchrun, "
          f"{args.epochs} epochs of {args.steps} steps (the first dropped), {args.repeats} interleaved repeats\n")
    header = "| job | " + " | ".join(f"{s} ({SIZES[s][0]} wide, batch {SIZES[s][1]}): ms/step, min-max, ratio"
                                      for s in sizes) + " |"
    print(header)
    print("|" + " --- |" * (len(sizes) + 1))
    for job in jobs:
        cells = []
        for size in sizes:
            values = results[size, job]
            base = statistics.median(results[size, "ddp"]) if "ddp" in jobs else float("nan")
            median = statistics.median(values)
            cells.append(f"{median * 1e3:.3f} ({min(values) * 1e3:.3f}-{max(values) * 1e3:.3f}), "
                         f"**{median / base:.3f}**")
        print(f"| {LABELS[job]} | " + " | ".join(cells) + " |")
    figures = {"repeats": args.repeats, "nproc": args.nproc, "steps": args.steps, "epochs": args.epochs}
    for size in sizes:
        for job in jobs:
            values = results[size, job]
            figures[f"{size}_{job}_ms"] = statistics.median(values) * 1e3
            figures[f"{size}_{job}_min_ms"] = min(values) * 1e3
            figures[f"{size}_{job}_max_ms"] = max(values) * 1e3
            if "ddp" in jobs:
                figures[f"{size}_{job}_ratio"] = statistics.median(values) / statistics.median(results[size, "ddp"])
    here = Path(__file__).resolve().parent
    record("peers-" + "-".join(sizes) + "-" + "-".join(jobs), figures, [here / "peers.py", here / "peers_worker.py"])
    runs = args.repeats * len(sizes)
    if EXIT_FAILURES:
        print("\nruns that exited non-zero after their timed epochs (a rank aborted at shutdown): "
              + ", ".join(f"{LABELS[j]} {n} of {runs}" for j, n in EXIT_FAILURES.items()))


def scaling(args: argparse.Namespace) -> None:
    """Steps/s at 1, 2 and 4 processes with the global batch fixed, plain DDP against the Trainer."""
    counts = [int(n) for n in args.procs.split(",")]
    jobs = [j for j in args.jobs.split(",") if j in ("ddp", "trainer", "own_loop")] or ["ddp", "trainer"]
    width, _ = SIZES[args.sizes.split(",")[0]]
    results = {(n, job): [] for n in counts for job in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for n in counts:
                shift = repeat % len(jobs)
                for job in jobs[shift:] + jobs[:shift]:
                    results[n, job].append(one(job, n, width, args.global_batch // n, args.steps, args.epochs, Path(tmp)))
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    print(f"\n{datetime.date.today()}, {versions()}; {machine()}; global batch {args.global_batch}, width {width}, "
          f"{args.repeats} interleaved repeats; optimizer steps/s (median, min-max)\n")
    others = [j for j in jobs if j != jobs[0]]
    print("| processes | " + " | ".join(LABELS[j] for j in jobs) + " | "
          + " | ".join(f"{LABELS[j]}: time per step / {LABELS[jobs[0]]}" for j in others) + " |")
    print("|" + " --- |" * (len(jobs) + len(others) + 1))
    for n in counts:
        rates = {job: [1.0 / v for v in results[n, job]] for job in jobs}
        cells = [f"{statistics.median(r):.1f} ({min(r):.1f}-{max(r):.1f})" for r in rates.values()]
        ratios = [statistics.median(rates[jobs[0]]) / statistics.median(rates[j]) for j in others]
        print(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(f"{r:.3f}" for r in ratios) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, from {', '.join(JOBS)}")
    parser.add_argument("--sizes", default="tiny,wide", help=f"comma-separated, from {', '.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per epoch")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--scaling", action="store_true", help="steps/s at --procs processes instead")
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--global-batch", type=int, default=128)
    args = parser.parse_args()
    unknown = [j for j in args.jobs.split(",") if j and j not in JOBS] + [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        parser.error(f"unknown job or size: {', '.join(unknown)}")
    (scaling if args.scaling else compare)(args)


if __name__ == "__main__":
    main()
