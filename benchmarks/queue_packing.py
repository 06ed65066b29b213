"""Runs packed onto one GPU: makespan and GPU utilisation of the digits runs file at K runs per GPU.

    python benchmarks/queue_packing.py [--runs-per-gpu 1,2,4] [--gpu 0] [--runs-file examples/digits/runs.yaml]

For each K: ``multigpu queue RUNS --gpus G --runs-per-gpu K`` into a fresh folder, while a sampler
reads the GPU's utilisation and memory through NVML (nvidia-ml-py, or ``nvidia-smi`` when it is not
installed) every 0.2 s. Prints, per K: makespan, the queue's own ideal, mean and median utilisation,
peak memory - and the speed-up of packing over K = 1. The runs are small models (the point of packing):
one alone leaves the GPU mostly idle while Python prepares each step.
Needs an NVIDIA GPU; ``--cpu-dry-run`` runs the queue on one CPU slot instead (no utilisation figures).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Sampler(threading.Thread):
    """GPU utilisation (%) and memory used (MiB) of one GPU, every ``period_s``."""

    def __init__(self, gpu: int, period_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.gpu, self.period_s = gpu, period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._read = self._nvml_reader() or self._smi_reader

    def _nvml_reader(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.gpu)
        except Exception:
            return None

        def read() -> tuple[float, float]:
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
            return float(rates.gpu), pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20

        return read

    def _smi_reader(self) -> tuple[float, float]:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--id={self.gpu}",
                "--query-gpu=utilization.gpu,memory.used",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        util, used = (float(v) for v in out.strip().split(","))
        return util, used

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except Exception:
                pass
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self.join()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs-per-gpu", default="1,2,4")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--runs-file", default=str(REPO / "examples" / "digits" / "runs.yaml"))
    parser.add_argument("--out", default="outputs/queue_packing")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="one CPU slot instead of a GPU (no GPU figures)"
    )
    args = parser.parse_args()
    ks = [int(k) for k in args.runs_per_gpu.split(",")]
    # the queue runs in REPO
    runs_file, out_root = Path(args.runs_file).resolve(), Path(args.out).resolve()
    if not args.cpu_dry_run and not shutil.which("nvidia-smi"):
        sys.exit("queue_packing.py needs an NVIDIA GPU (--cpu-dry-run checks it on the CPU)")
    rows = []
    for k in ks:
        out = out_root / f"k{k}"
        shutil.rmtree(out, ignore_errors=True)
        where = ["--slots", "1"] if args.cpu_dry_run else ["--gpus", str(args.gpu)]
        command = [
            sys.executable,
            "-m",
            "multigpu",
            "queue",
            str(runs_file),
            *where,
            "--runs-per-gpu",
            str(k),
            "--out",
            str(out),
            "--no-live",
        ]
        sampler = None if args.cpu_dry_run else Sampler(args.gpu)
        if sampler:
            sampler.start()
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - started
        if sampler:
            sampler.stop()
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            sys.exit(f"the queue with --runs-per-gpu {k} failed (exit {proc.returncode})")
        match = re.search(r"makespan ([\d.]+) s for ([\d.]+) s of runs", proc.stdout)
        statuses = [json.loads(p.read_text()) for p in out.glob("*/status.json")]
        if not statuses:
            sys.exit(f"the queue with --runs-per-gpu {k} left no run status in {out}")
        span = float(match.group(1)) if match else wall
        util = [u for u, _ in sampler.samples] if sampler else []
        row = {
            "k": k,
            "runs": len(statuses),
            "makespan_s": span,
            "wall_s": wall,
            "run_s_median": statistics.median(s["ended"] - s["started"] for s in statuses),
            "util_mean": statistics.mean(util) if util else None,
            "util_median": statistics.median(util) if util else None,
            "memory_peak_mib": max((m for _, m in sampler.samples), default=None)
            if sampler
            else None,
        }
        rows.append(row)
        print(f"K={k}: {row['runs']} runs, makespan {span:.1f} s", flush=True)
    base = rows[0]["makespan_s"]
    print(
        f"\n{'K':>3}{'runs':>6}{'makespan s':>12}{'speed-up':>10}{'run s (median)':>16}{'GPU util mean':>15}"
        f"{'median':>8}{'peak MiB':>10}"
    )
    for row in rows:
        util = (
            f"{row['util_mean']:>14.0f}%{row['util_median']:>7.0f}%"
            if row["util_mean"] is not None
            else f"{'-':>15}{'-':>8}"
        )
        memory = (
            f"{row['memory_peak_mib']:>10.0f}"
            if row["memory_peak_mib"] is not None
            else f"{'-':>10}"
        )
        print(
            f"{row['k']:>3}{row['runs']:>6}{row['makespan_s']:>12.1f}{base / row['makespan_s']:>9.2f}x"
            f"{row['run_s_median']:>16.1f}{util}{memory}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
