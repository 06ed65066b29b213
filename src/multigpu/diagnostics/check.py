"""``multigpu check SCRIPT --nproc N --steps K``: does *your* script compute on N processes what it computes on one?

It runs the script twice through ``multigpu run``, unchanged: on N processes with its own batch size
b per process, and on one process whose loaders (``run.loader``, the Trainer's) give N x b samples per
step. Both runs stop after K optimizer steps (see :mod:`multigpu.guards.probe`, which records
them). Then it compares the loss of every step and every weight, prints a table, and when they
differ says why - from what it measured, not from guesses:

- the loader is not sharded: every rank's inputs were identical at every step;
- the loader's batch did not scale, or drop_last/padding changed how many samples a step saw;
- BatchNorm without SyncBatchNorm: each rank normalises with its own b samples;
- a loss summed over the batch, or gradients summed over ranks: step 1's loss or first update differ
  by a factor of N;
- every rank draws the same random numbers (an augmentation seeded alike on every rank);
- parameters that get no gradient (DDP then fails at step 2 unless find_unused_parameters);
- a metric averaged over the ranks' means while ranks evaluated different numbers of samples.

Dropout is switched off in both runs (it cannot draw the same masks for one batch of N x b as for N
batches of b); everything else is the script's own.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from multigpu import validate
from multigpu.guards.probe import DIR_VAR, SCALE_VAR, STEPS_VAR
from multigpu.errors import LaunchError

METRIC_CAUSE = "a metric is averaged"
EPS = {"float32": 1.2e-7, "float64": 2.2e-16, "bfloat16": 7.8e-3, "float16": 9.8e-4}


@dataclass
class Outcome:
    """What one run of the script left: per-rank step records, the layers found, the weights."""

    folder: Path
    status: int
    output: str
    ranks: list[list[dict]] = field(default_factory=list)
    model: dict = field(default_factory=dict)

    @classmethod
    def read(cls, folder: Path, status: int, output: str) -> "Outcome":
        ranks = []
        for path in sorted(folder.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:])):
            lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            ranks.append([json.loads(line) for line in lines])
        model = json.loads((folder / "model.json").read_text()) if (folder / "model.json").exists() else {}
        return cls(folder, status, output, ranks, model)

    @property
    def steps(self) -> int:
        return min((len(r) for r in self.ranks), default=0)

    def weights(self, name: str = "weights.pt") -> Optional[dict]:
        import torch

        path = self.folder / name
        return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None

    def loss(self, step: int) -> Optional[float]:
        """The global loss of a step: the ranks' losses weighted by their samples (their means' mean)."""
        rows = [r[step] for r in self.ranks if len(r) > step and r[step].get("loss") is not None]
        total = sum(row["samples"] for row in rows)
        if not rows:
            return None
        if total == 0:
            return sum(row["loss"] for row in rows) / len(rows)
        return sum(row["loss"] * row["samples"] for row in rows) / total

    def samples(self, step: int) -> int:
        return sum(r[step]["samples"] for r in self.ranks if len(r) > step)

    def error_line(self) -> str:
        lines = [line for line in self.output.splitlines() if "error" in line.lower() or "Error" in line]
        return (lines[-1] if lines else (self.output.strip().splitlines() or ["(no output)"])[-1]).strip()[:300]


def _run(command: Sequence[str], nproc: int, scale: int, steps: int, folder: Path, cpu: bool,
         timeout_s: float, procs_per_gpu: int = 1) -> Outcome:
    folder.mkdir(parents=True)
    sharing = ["--procs-per-gpu", str(procs_per_gpu)] if procs_per_gpu > 1 else []
    argv = [sys.executable, "-m", "multigpu", "run", "--nproc", str(nproc), *sharing, "--tee-prefix", "never",
            *(["--cpu"] if cpu else []), *command]
    env = {**os.environ, DIR_VAR: str(folder), STEPS_VAR: str(steps), SCALE_VAR: str(scale)}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"the {nproc}-process run did not finish in {timeout_s:.0f} s.",
                          "lower --steps, or give --timeout more seconds.") from None
    return Outcome.read(folder, done.returncode, done.stdout + done.stderr)


#: The default tolerance never exceeds this: a summed loss (1/N), doubled gradients (N x) or BatchNorm
#: drift must stay visible under bf16/fp16 autocast, whose eps alone would allow several times the value.
MAX_TOLERANCE = 2e-2


def _tolerance(dtype: Optional[str], steps: int, given: Optional[float]) -> float:
    if given is not None:
        return given
    return min(MAX_TOLERANCE, 500 * EPS.get(dtype or "float32", EPS["float32"]) * math.sqrt(max(steps, 1)))


def _finite_or_inf(value: float) -> float:
    """A NaN difference (a run that diverged) must never look small: max() would skip it."""
    return value if math.isfinite(value) else math.inf


def _weight_differences(many: dict, one: dict) -> list[tuple[str, float, float]]:
    rows = []
    for name in sorted(set(many) | set(one)):
        if name not in many or name not in one or many[name].shape != one[name].shape:
            rows.append((name, math.inf, math.inf))
            continue
        a, b = many[name].double(), one[name].double()
        diff = _finite_or_inf((a - b).abs().max().item()) if a.numel() else 0.0
        scale = b.abs().max().item() if b.numel() else 0.0
        rows.append((name, diff, _finite_or_inf(diff / scale) if scale > 0 else diff))
    return rows


def _update_ratio(many: Outcome, one: Outcome) -> Optional[float]:
    m0, m1 = many.weights("weights0.pt"), many.weights("weights1.pt")
    o0, o1 = one.weights("weights0.pt"), one.weights("weights1.pt")
    if not (m0 and m1 and o0 and o1):
        return None
    num = sum(((m1[k].double() - m0[k].double()) ** 2).sum().item() for k in m0 if k in m1 and m1[k].is_floating_point())
    den = sum(((o1[k].double() - o0[k].double()) ** 2).sum().item() for k in o0 if k in o1 and o1[k].is_floating_point())
    return math.sqrt(num / den) if den > 0 else None


def diagnose(many: Outcome, one: Outcome, nproc: int) -> list[str]:
    """The causes the records show, most basic first."""
    found: list[str] = []
    steps = min(many.steps, one.steps)
    world = len(many.ranks)
    if world > 1 and steps:
        same = all(len({tuple(r[i]["inputs"]) for r in many.ranks}) == 1 and many.ranks[0][i]["inputs"]
                   for i in range(steps))
        if same:
            found.append("every rank trained on the same batches at every step: the loader is not sharded. Build it "
                         "with run.loader(dataset or DataLoader) - or give your DataLoader a DistributedSampler.")
    if steps and one.samples(0) and one.samples(0) * nproc == many.samples(0):
        found.append(f"the one-process run saw {one.samples(0)} samples in step 1 where {nproc} processes saw "
                     f"{many.samples(0)}: its loader was not scaled, so it is not built by run.loader (or the "
                     "Trainer). Build loaders with run.loader so the batch size is per process.")
    else:
        for i in range(steps):
            if many.samples(i) != one.samples(i):
                found.append(f"step {i + 1}: {nproc} processes saw {many.samples(i)} samples, one process "
                             f"{one.samples(i)}: drop_last or the sampler's padding (DistributedSampler repeats "
                             "samples to fill the last batch) changes what a step trains on.")
                break
    batchnorms = many.model.get("batchnorm_count", 0)
    if batchnorms and world > 1:
        names = ", ".join(many.model.get("batchnorms", [])[:3])
        found.append(f"{batchnorms} BatchNorm layer(s) ({names}) normalise with each rank's own batch: convert them "
                     "with torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before run.setup, or expect "
                     "this difference.")
    if steps:
        a, b = many.loss(0), one.loss(0)
        if a and b and abs(a / b - 1 / nproc) < 0.02 / nproc:
            found.append(f"step 1's loss on {nproc} processes is 1/{nproc} of one process's ({a:.6g} against {b:.6g}): "
                         "the loss is summed over the batch (reduction='sum'). Average it (reduction='mean'), or "
                         f"scale it by 1/{nproc} when its samples are split across ranks.")
        ratio = _update_ratio(many, one)
        if ratio is not None and (abs(ratio - nproc) < 0.05 * nproc or abs(ratio - 1 / nproc) < 0.05 / nproc):
            found.append(f"the first update on {nproc} processes is {ratio:.3g}x one process's: gradients are summed "
                         "(an all-reduce SUM on top of DDP's average, or a summed loss). Let DDP average them.")
    if world > 1 and steps >= 2:
        same_rng = sum(1 for i in range(steps) if len({tuple(r[i]["rng"]) for r in many.ranks}) == 1
                       and many.ranks[0][i]["rng"])
        moved = sum(1 for i in range(1, steps) if many.ranks[0][i]["rng"] and many.ranks[0][i - 1]["rng"]
                    and many.ranks[0][i]["rng"][0] != many.ranks[0][i - 1]["rng"][-1])
        if same_rng >= max(1, steps // 2) and moved >= max(1, (steps - 1) // 2):
            found.append("every rank draws the same random numbers at every step (an augmentation or noise seeded "
                         "alike on every rank, e.g. torch.manual_seed(0) after mg.init): ranks repeat each other's "
                         "randomness. Seed through mg.init(seed=...) (per rank after run.setup) or seed each rank "
                         "differently.")
    for outcome, label in ((many, f"{nproc} processes"), (one, "one process")):
        first = outcome.ranks[0][0] if outcome.ranks and outcome.ranks[0] else {}
        unused = first.get("no_grad") or []
        if unused:
            found.append(f"{len(unused)} parameter(s) got no gradient in step 1 on {label} ({', '.join(unused[:3])}): "
                         "DDP fails at the next step unless run.setup(model, opt, find_unused_parameters=True); or "
                         "remove them from the model.")
            break
    if world > 1:
        last = [r[-1] for r in many.ranks if r]
        counts = {row.get("eval_samples", 0) for row in last}
        if any(row.get("averaged_scalars", 0) for row in last) and len(counts) > 1:
            found.append(f"{METRIC_CAUSE} over the ranks' means (an all_reduce with ReduceOp.AVG) while ranks "
                         f"evaluated {' and '.join(str(c) for c in sorted(counts))} samples: the mean of means is "
                         "not the mean. All-reduce sums and counts (run.metric_sums()) instead.")
    return found


def check(command: Sequence[str], nproc: int, steps: int, cpu: bool = False, tolerance: Optional[float] = None,
          keep: bool = False, timeout_s: float = 600.0, out=print, procs_per_gpu: int = 1) -> int:
    """Run, compare, print the verdict; 0 when equal within the tolerance.

    ``procs_per_gpu``: the N processes share the GPUs K to a GPU (a one-GPU machine checks 2 processes
    with ``nproc=2, procs_per_gpu=2``); the one-process run has a GPU to itself."""
    validate.count(nproc, "--nproc", LaunchError, low=2, high=validate.MAX_PROCS_PER_NODE,
                   hint="compare 2 or more processes against one.")
    validate.count(steps, "--steps", LaunchError, low=1, high=10_000)
    if procs_per_gpu != 1:  # refuse an impossible device plan now, not as a failed run
        from multigpu.launch.devices import plan_devices, visible_gpus

        plan_devices(visible_gpus(), nproc=nproc, procs_per_gpu=procs_per_gpu, cpu=cpu)
    root = Path(tempfile.mkdtemp(prefix="multigpu-check-"))
    try:
        out(f"multigpu check: {' '.join(command)}: {nproc} processes (their own batch each) against 1 process "
            f"(the {nproc}x batch), {steps} optimizer step(s); dropout off in both")
        many = _run(command, nproc, 1, steps, root / f"n{nproc}", cpu, timeout_s, procs_per_gpu)
        one = _run(command, 1, nproc, steps, root / "n1", cpu, timeout_s)
        return _report(many, one, nproc, steps, tolerance, out)
    finally:
        if keep:
            out(f"records kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _report(many: Outcome, one: Outcome, nproc: int, steps: int, tolerance: Optional[float], out) -> int:
    causes = diagnose(many, one, nproc)
    for outcome, label in ((many, f"{nproc}-process"), (one, "1-process")):
        if outcome.status != 0 or outcome.steps < steps:
            if outcome.steps == 0:
                out(f"the {label} run recorded no step (exit {outcome.status}): {outcome.error_line()}")
                out("HINT: the script must build its model with run.setup (or the Trainer) and step an optimizer; "
                    "run it with `multigpu run` first.")
                return 2
            out(f"the {label} run stopped after {outcome.steps} of {steps} step(s) (exit {outcome.status}): "
                f"{outcome.error_line()}")
    dtype = next((r[0].get("dtype") for r in one.ranks if r and r[0].get("dtype")), None) or "float32"
    tol = _tolerance(dtype, steps, tolerance)
    out(f"\n{'step':>4}  {'loss, ' + str(nproc) + ' procs':>15}  {'loss, 1 proc':>15}  {'rel. diff':>9}  samples")
    worst_loss = 0.0
    no_losses = all(many.loss(i) is None and one.loss(i) is None for i in range(min(many.steps, one.steps)))
    for i in range(min(many.steps, one.steps)):
        a, b = many.loss(i), one.loss(i)
        if a is None and b is None:
            rel = 0.0  # neither run reported its loss (see the note below): the weights decide
        elif a is None or b is None:
            rel = math.inf
        else:
            rel = _finite_or_inf(abs(a - b) / max(abs(b), 1e-12))
        worst_loss = max(worst_loss, rel)
        out(f"{i + 1:>4}  {a if a is not None else float('nan'):>15.8g}  {b if b is not None else float('nan'):>15.8g}  "
            f"{rel:>9.2e}  {many.samples(i)} / {one.samples(i)}")
    if no_losses:
        out("(no losses: the script calls loss.backward() itself; call run.backward(loss) to have them compared)")
    weights_many, weights_one = many.weights(), one.weights()
    worst_weight = math.inf
    if weights_many is not None and weights_one is not None:
        rows = _weight_differences(weights_many, weights_one)
        worst = max(rows, key=lambda row: row[2]) if rows else ("-", 0.0, 0.0)
        worst_weight = worst[2]
        out(f"\nweights after step {steps}: {len(rows)} tensor(s); largest difference {worst[1]:.3g} in {worst[0]} "
            f"({worst[2]:.3g} of its largest value)")
    same_samples = all(many.samples(i) == one.samples(i) for i in range(min(many.steps, one.steps)))
    equal = (many.status == 0 and one.status == 0 and many.steps >= steps and one.steps >= steps
             and worst_loss <= tol and worst_weight <= tol and same_samples)
    metric = [cause for cause in causes if cause.startswith(METRIC_CAUSE)]
    if equal and metric:
        out(f"verdict: training EQUAL (within {tol:.2g}, {dtype}), but a reported metric is not:")
        out(f"  - {metric[0]}")
        return 1
    if equal:
        out(f"verdict: EQUAL - {nproc} processes compute what 1 process computes (within {tol:.2g}, {dtype})")
        return 0
    out(f"verdict: DIFFERENT - loss differs by up to {worst_loss:.3g}, weights by {worst_weight:.3g} "
        f"(tolerance {tol:.2g}, {dtype}){'' if same_samples else '; the runs trained on different sample counts'}")
    if causes:
        out("why:")
        for cause in causes:
            out(f"  - {cause}")
    else:
        out("why: none of the usual causes was seen (sharding, batch size, BatchNorm, summed losses, shared random "
            "streams, unused parameters, averaged metrics). Run again with --keep and compare the records.")
    return 1
