"""What the step extras cost per optimizer step (docs/observability.md): the Trainer with its defaults
(profiling, averaging and the step guard off) against each of them on.

    python benchmarks/extras_overhead.py [--repeats 7] [--width 16]                 # one process
    multigpu run --nproc 2 benchmarks/extras_overhead.py [--repeats 7]             # the guard's agreement too
    PYTHONPATH=<another checkout>/src python benchmarks/extras_overhead.py --only defaults   # compare trees

A model so small that the loop's own work is most of the step. The clock is a forward pre-hook: the
median gap between training forwards after 20 warm-up steps, in wall time and in this thread's CPU
time (which other processes on a busy machine disturb less). The settings run interleaved, ``repeats``
times each; the table shows the median of the medians.
"""

import argparse
import itertools
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

SETTINGS = {
    "defaults": {},
    "skip_nonfinite": {"skip_nonfinite": True},
    "ema 0.999": {"ema": 0.999},
    # the norm the guard reads, alone: separates the two costs
    "clip_grad_norm 1e9": {"clip_grad_norm": 1e9},
}


RUNS = itertools.count()


class Fit(mg.Trainer):
    def compute_loss(self, batch):
        return F.cross_entropy(self.model(batch[0]), batch[1])


def folder(run) -> str:
    """One folder for every rank of this launch (the rendezvous id), removed at the end."""
    return f"{tempfile.gettempdir()}/multigpu-extras-overhead-{run.world.launch_id or os.getpid()}"


def measure(run, width: int, settings: dict) -> tuple[float, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    wall: list[float] = []
    cpu: list[float] = []

    def stamp(module, inputs) -> None:
        wall.append(time.perf_counter())
        cpu.append(time.thread_time())

    model.register_forward_pre_hook(stamp)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(6400 // run.dp_size * run.dp_size, width, generator=g),
        torch.randint(0, 10, (6400 // run.dp_size * run.dp_size,), generator=g),
    )
    Fit(
        run,
        model,
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
        batch_size=32 // run.dp_size,
        epochs=1,
        out_dir=f"{folder(run)}/{next(RUNS)}",
        progress=False,
        plot=False,
        log_every_n_steps=0,
        check_consistency=False,
        **settings,
    ).fit(data)

    def gap(stamps: list[float]) -> float:
        kept = stamps[20:]
        return statistics.median(b - a for a, b in zip(kept, kept[1:])) * 1e6

    return gap(wall), gap(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--only", choices=sorted(SETTINGS), nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = mg.init()
    chosen = {name: SETTINGS[name] for name in (args.only or SETTINGS)}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in chosen}
    for _ in range(args.repeats):
        for name, settings in chosen.items():
            results[name].append(measure(run, args.width, settings))
    base_wall = statistics.median(w for w, _ in results[next(iter(chosen))])
    base_cpu = statistics.median(c for _, c in results[next(iter(chosen))])
    run.barrier()
    if run.is_main:
        shutil.rmtree(folder(run), ignore_errors=True)
        print(
            f"torch {torch.__version__}, {run.world_size} process(es) on {run.device.type}, width {args.width}, "
            f"{args.repeats} repeats (medians)"
        )
        for name, values in results.items():
            wall, cpu = (
                statistics.median(w for w, _ in values),
                statistics.median(c for _, c in values),
            )
            print(
                f"{name:20s} wall {wall:7.1f} us/step ({wall - base_wall:+6.1f})   "
                f"cpu {cpu:7.1f} us/step ({cpu - base_cpu:+6.1f})"
            )


if __name__ == "__main__":
    main()
