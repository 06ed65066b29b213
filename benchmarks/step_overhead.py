"""Per-step Python overhead of the Trainer and the own-loop helpers, in one process, on a model so small
that the overhead is most of the step.

    python benchmarks/step_overhead.py [--repeats 5] [--width 16]

Three loops over the same data, interleaved: a bare loop (DataLoader, forward, backward, step), the
own-loop helpers (run.setup, run.loader, run.backward, step_done, should_stop) and the Trainer with
its defaults. The clock is a forward pre-hook (the median gap between training forwards after 20
warm-up steps). What the Trainer adds per step shows as microseconds here; the two-process comparison
with the peers is benchmarks/peers.py.
"""

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multigpu as mg
from record import record


def build(width: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    stamps: list[float] = []
    model.register_forward_pre_hook(lambda module, inputs: stamps.append(time.perf_counter()))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(3200, width, generator=g), torch.randint(0, 10, (3200,), generator=g))
    return model, data, stamps


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def gap_us(stamps: list[float]) -> float:
    kept = stamps[20:]
    return statistics.median(b - a for a, b in zip(kept, kept[1:])) * 1e6


class Fit(mg.Trainer):
    def compute_loss(self, batch):
        return F.cross_entropy(self.model(batch[0]), batch[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = mg.init(env={})
    results: dict[str, list[float]] = {"bare loop": [], "own loop (helpers)": [], "Trainer (defaults)": []}
    for _ in range(args.repeats):
        model, data, stamps = build(args.width)
        optimizer = sgd(model.parameters())
        for inputs, labels in DataLoader(data, batch_size=32, shuffle=True):
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        results["bare loop"].append(gap_us(stamps))

        model, data, stamps = build(args.width)
        model, optimizer = run.setup(model, sgd)
        step = 0
        for inputs, labels in run.loader(data, batch_size=32, quiet=True):
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            run.backward(loss)
            optimizer.step()
            step += 1
            run.step_done(step)
            run.should_stop()
        results["own loop (helpers)"].append(gap_us(stamps))

        model, data, stamps = build(args.width)
        with tempfile.TemporaryDirectory() as out:
            Fit(run, model, sgd, batch_size=32, epochs=1, out_dir=out, progress=False, plot=False).fit(data)
        results["Trainer (defaults)"].append(gap_us(stamps))
    bare = statistics.median(results["bare loop"])
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:20s} {median:7.1f} us/step (min {min(values):.1f}, max {max(values):.1f}), "
              f"+{median - bare:.1f} us over the bare loop")
    keys = {"bare loop": "bare", "own loop (helpers)": "own_loop", "Trainer (defaults)": "trainer"}
    record("step_overhead", {f"{keys[name]}_us": statistics.median(values) for name, values in results.items()}
           | {"repeats": args.repeats, "width": args.width}, [__file__])


if __name__ == "__main__":
    main()
