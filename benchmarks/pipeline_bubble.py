"""The pipeline bubble, measured per schedule: the share of a step each stage's rank is not working.

    multigpu run --nproc 2 benchmarks/pipeline_bubble.py [--repeats 3] [--steps 3] [--ms-per-row 0.25]

pp = 2 processes, torch.distributed.pipelining's schedules through ``train_step``, 8 equal blocks split
by parameters (4 per rank; 2 stages of 2 per rank for interleaved_1f1b), a batch of 64 rows. Each
block's work is a timed wait proportional to its rows - ``--ms-per-row`` forward, twice that backward -
so the figure is the schedule's (its order of work, its waits for the other stage, its point-to-point
sends and Python), not the load of the machine it runs on: CPU processes sharing 2 busy cores would
otherwise measure the other jobs. Per rank: ``idle = 1 - work / step``, the work being the waits'
measured durations; the step the fastest of the repeats. The theory (equal stages, free communication):
gpipe and 1f1b idle (p - 1) / (m + p - 1) of a step, interleaved with v stages per rank
(p - 1) / (v m + p - 1).
"""

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import multigpu as mg

CASES = [
    ("gpipe", 2),
    ("gpipe", 4),
    ("gpipe", 8),
    ("1f1b", 2),
    ("1f1b", 4),
    ("1f1b", 8),
    ("interleaved_1f1b", 4),
    ("interleaved_1f1b", 8),
]
WORKED = [0.0]  # seconds of block work on this rank, measured around each wait


class Wait(torch.autograd.Function):
    """A block's work: ``seconds`` forward, twice that backward (the usual ratio), timed."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        _work(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _work(2 * ctx.seconds)
        return grad, None


def _work(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    WORKED[0] += time.perf_counter() - start


class Block(nn.Module):
    def __init__(self, per_row: float) -> None:
        super().__init__()
        self.linear, self.per_row = nn.Linear(16, 16), per_row

    def forward(self, x):
        return Wait.apply(self.linear(x), self.per_row * x.shape[0])


def theory(schedule: str, micro: int, pp: int) -> float:
    v = 2 if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * micro + pp - 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ms-per-row", type=float, default=0.25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = mg.init(pp=2, timeout_s=300)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g))
    rows = []
    for schedule, micro in CASES:
        torch.manual_seed(0)
        model = nn.Sequential(*(Block(args.ms_per_row / 1e3) for _ in range(8)))
        parts, optimizer = run.setup(
            model, lambda p: torch.optim.SGD(p, lr=1e-3), schedule=schedule, micro_batches=micro
        )

        def step(parts=parts, optimizer=optimizer) -> None:
            parts.train_step(batch, lambda m: F.mse_loss(parts(m[0]), m[1]))
            optimizer.zero_grad(set_to_none=True)

        step()  # warm-up: the schedule's shapes, the first sends
        fractions, times = [], []
        for _ in range(args.repeats):
            WORKED[0] = 0.0
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            elapsed = time.perf_counter() - start
            times.append(elapsed / args.steps)
            fractions.append(1 - WORKED[0] / elapsed)
        mine = torch.tensor([min(times), fractions[times.index(min(times))]], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(run.world_size)]
        dist.all_gather(every, mine)
        rows.append(
            (
                schedule,
                micro,
                max(t[0].item() for t in every),
                [t[1].item() for t in every],
                theory(schedule, micro, 2),
            )
        )
    if run.is_main:
        print(
            f"pipeline bubble, pp 2, {platform.machine()} CPU processes (gloo), torch {torch.__version__}, "
            f"{datetime.date.today()}, load average {os.getloadavg()[0]:.1f}; 8 blocks of "
            f"{args.ms_per_row} ms per row forward (2x backward), batch 64, fastest of {args.repeats} x "
            f"{args.steps} steps"
        )
        print(
            f"{'schedule':<18}{'micro-batches':>14}{'step ms':>9}{'idle (mean; per rank)':>26}{'theory':>8}"
        )
        for schedule, micro, step_s, idle, expected in rows:
            per_rank = ", ".join(f"{i:.2f}" for i in idle)
            print(
                f"{schedule:<18}{micro:>14}{step_s * 1e3:>9.1f}{statistics.mean(idle):>12.2f} ({per_rank})"
                f"{expected:>8.2f}"
            )


if __name__ == "__main__":
    main()
