"""Trainer overhead against a hand-written DDP loop: same model, data and processes, side by side.

    python benchmarks/overhead.py [--repeats 7] [--nproc 2] [--steps 150]

Runs the two implementations alternately (interleaved, so machine noise hits both alike), each as a
real ``multigpu run --nproc 2`` job on gloo, takes the per-step time of epochs 2-3 (epoch 1 warms up),
and prints the medians and their ratio. Target: Trainer / manual <= 1.02.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one(impl: str, args, folder: Path, index: int) -> list[float]:
    out = folder / f"{impl}{index}.json"
    cmd = [sys.executable, "-m", "multigpu", "run", "--nproc", str(args.nproc), str(HERE / "overhead_worker.py"),
           "--impl", impl, "--steps", str(args.steps), "--width", str(args.width), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"trainer": [], "manual": []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.repeats):
            order = ("trainer", "manual") if index % 2 == 0 else ("manual", "trainer")
            for impl in order:
                times[impl] += one(impl, args, Path(tmp), index)
            print(f"repeat {index + 1}/{args.repeats}: trainer {statistics.median(times['trainer']) * 1e3:.3f} ms, "
                  f"manual {statistics.median(times['manual']) * 1e3:.3f} ms (running medians)", flush=True)
    trainer, manual = statistics.median(times["trainer"]), statistics.median(times["manual"])
    print(f"\nper-step time, median of {len(times['trainer'])} epochs each, {args.nproc} gloo processes:")
    print(f"  Trainer          {trainer * 1e3:8.3f} ms")
    print(f"  hand-written DDP {manual * 1e3:8.3f} ms")
    print(f"  ratio            {trainer / manual:8.3f}  (target <= 1.02)")


if __name__ == "__main__":
    main()
