"""Checkpoint save time: multigpu's atomic, verified save against a plain ``torch.save`` of the same state.

    python benchmarks/checkpoint_save.py [--params 20e6] [--repeats 7] [--dir /tmp]

The state is a model of --params float32 parameters plus AdamW's two moments (3x the model). Runs are
interleaved (plain, multigpu, plain+fsync, ...); medians and ratios are printed. multigpu's save also
checksums every byte (CRC-32, while writing), fsyncs the files and the folder, and renames it into place.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from multigpu import checkpoint


def make_state(n_params: int) -> dict:
    model = {f"layer{i}.weight": torch.randn(n_params // 8) for i in range(8)}
    moments = {i: {"exp_avg": torch.randn(n_params // 8), "exp_avg_sq": torch.rand(n_params // 8), "step": torch.tensor(10.0)}
               for i in range(8)}
    return {"model": model, "optimizer": {"state": moments, "param_groups": [{"lr": 1e-3, "params": list(range(8))}]},
            "trainer": {"epoch": 1, "batch_in_epoch": 0, "global_step": 100}}


def plain(state: dict, folder: Path, fsync: bool) -> None:
    path = folder / "plain.pt"
    with open(path, "wb") as handle:
        torch.save(state, handle)
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())


def ours(state: dict, folder: Path, step: int) -> None:
    checkpoint.save_state(folder / "ckpts", step, state)
    checkpoint.prune(folder / "ckpts", keep_last=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=20e6)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    state = make_state(int(args.params))
    size_mb = sum(t.numel() * 4 for t in state["model"].values()) * 3 / 2**20
    times = {"torch.save": [], "torch.save+fsync": [], "multigpu": []}
    folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-bench-"))
    try:
        for index in range(args.repeats):
            runs = [("torch.save", lambda: plain(state, folder, False)),
                    ("torch.save+fsync", lambda: plain(state, folder, True)),
                    ("multigpu", lambda step=index: ours(state, folder, step))]
            for name, fn in (runs if index % 2 == 0 else runs[::-1]):
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    base = statistics.median(times["torch.save"])
    print(f"state of {size_mb:.0f} MiB (model + AdamW moments), median of {args.repeats} interleaved saves:")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:17s} {median:7.3f} s  {size_mb / median:7.0f} MiB/s  ratio to torch.save {median / base:5.2f}")


if __name__ == "__main__":
    main()
