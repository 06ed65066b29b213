"""What ``multigpu check``'s records say: every cause the evidence of the two runs supports.

Why apart from the command (:mod:`multigpu.diagnostics.check`): the command starts processes and
prints; this module only reasons over records (per-rank step rows, the layers found, the weights after
K steps) - pure functions, tested against recorded cases without launching anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from multigpu.diagnostics.outcome import Outcome, update_ratio, weight_differences

#: Kinds of cause. BLOCKING: N processes do not train as one process does, whatever the numbers say.
#: NUMERIC: explains a difference in the numbers (only found when there is one). WRONG: a mistake on
#: any number of processes (both runs make it, so the numbers agree).
BLOCKING, NUMERIC, WRONG = "blocking", "numeric", "wrong"


@dataclass
class Cause:
    kind: str
    text: str


def _steps_text(steps: Sequence[int]) -> str:
    """1-based step numbers, as a short list: '1, 2, 3' or '1-7'."""
    numbers = [s + 1 for s in steps]
    if len(numbers) > 3 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]}-{numbers[-1]}"
    return ", ".join(str(n) for n in numbers[:8]) + (", ..." if len(numbers) > 8 else "")


# ------------------------------------------------------------------------------------------ causes
def _rank_steps(many: Outcome) -> list[Cause]:
    counts = [len(r) for r in many.ranks]
    if len(counts) < 2 or (min(counts) == max(counts) and not many.stranded):
        return []
    most = max(counts)
    behind = [r for r, n in enumerate(counts) if n < most] or many.stranded
    ahead = [r for r, n in enumerate(counts) if n == most]
    return [
        Cause(
            BLOCKING,
            f"rank(s) {', '.join(map(str, behind))} stepped the optimizer "
            f"{', '.join(str(counts[r]) for r in behind)} time(s) while rank(s) {', '.join(map(str, ahead))} "
            f"stepped it {most} time(s) over the same forward and backward passes: an optimizer step that "
            "only some ranks take (e.g. `if rank == 0: optimizer.step()`). Every rank must step, or the replicas "
            "drift apart and the next all-reduce waits for ranks that are gone.",
        )
    ]


def _identical_inputs(many: Outcome) -> list[Cause]:
    steps: list[int] = []
    pairs: set[tuple[int, int]] = set()
    for i in range(many.most_steps):
        rows = [(r, row) for r, row in enumerate(many.at(i))]
        for a in range(len(rows)):
            for b in range(a + 1, len(rows)):
                (ra, x), (rb, y) = rows[a], rows[b]
                if x.get("dp_rank", ra) == y.get("dp_rank", rb):
                    continue  # tensor-parallel peers read the same data on purpose
                if set(filter(None, x["inputs"])) & set(filter(None, y["inputs"])):
                    pairs.add((ra, rb))
                    if not steps or steps[-1] != i:
                        steps.append(i)
    if not steps:
        return []
    ranks = sorted({r for pair in pairs for r in pair})
    names = ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    return [
        Cause(
            BLOCKING,
            f"ranks {names} trained on identical inputs at step(s) "
            f"{_steps_text(steps)}: the data is not split across ranks - a plain DataLoader, or random "
            "offsets drawn with the same seed on every rank (nanoGPT's get_batch after a torch.manual_seed "
            "that is the same on every rank). Build the loader with run.loader(dataset) (an offsets Dataset "
            "for random windows), or give each rank its own generator; see docs/migrating.md.",
        )
    ]


def _batch_causes(many: Outcome, one: Outcome, nproc: int) -> list[Cause]:
    """Micro-steps per optimizer step and samples per micro-step, compared: which of accumulation,
    batch size, loader scaling or padding differs between the runs."""
    # steps every rank recorded (a rank that never stepped has none)
    steps = min(many.steps, one.steps)
    seen = all(
        row["samples"] for outcome in (many, one) for i in range(steps) for row in outcome.at(i)
    )
    if not steps or not seen:
        return []  # a step whose forwards were not seen (see _unverified): nothing to compare
    found: list[Cause] = []
    micro_many = [max(row["forwards"] for row in many.at(i)) for i in range(steps)]
    micro_one = [one.at(i)[0]["forwards"] for i in range(steps)]
    first_many = next((size for row in many.at(0) for size in row["rows"] if size), 0)
    first_one = next((size for row in one.at(0) for size in row["rows"] if size), 0)
    global_many, global_one = many.samples(0), one.samples(0)
    accumulation = micro_many != micro_one
    if accumulation:
        found.append(
            Cause(
                BLOCKING,
                f"the micro-steps per optimizer step depend on the number of processes: 1 process "
                f"ran {micro_one[0]} forward pass(es) per optimizer step, each of {nproc} processes "
                f"{micro_many[0]} - gradient accumulation divided by the world size (nanoGPT's "
                "`gradient_accumulation_steps //= world_size`). With the batch per process, that makes the "
                f"one-process run train on {global_one} samples per step where {nproc} processes train on "
                f"{global_many}. Keep the accumulation steps the same on any number of processes (global "
                "batch = batch x processes x accumulation); see docs/migrating.md.",
            )
        )
    if first_many and first_one:
        if first_one == first_many:
            found.append(
                Cause(
                    BLOCKING,
                    f"the one-process run's forward passes held {first_one} samples, as many as "
                    f"each of {nproc} processes: its batch was not scaled by {nproc}, so it does not come "
                    "from run.loader (a plain DataLoader, or batches made by hand like nanoGPT's get_batch). "
                    "The check scales only loaders built by run.loader (or the Trainer): pass your Dataset "
                    "or DataLoader through run.loader (an offsets Dataset for random windows).",
                )
            )
        elif first_one != nproc * first_many:
            asked = f"{first_one // nproc}" if first_one % nproc == 0 else f"{first_one}/{nproc}"
            found.append(
                Cause(
                    BLOCKING,
                    f"the batch per process depends on the number of processes: each of {nproc} "
                    f"processes ran forward passes of {first_many} samples, the one-process run of "
                    f"{first_one} ({nproc} x the {asked} the script asked for on one process) - e.g. "
                    "batch_size = global_batch // world_size. The batch given to run.loader is per process: "
                    "give it the same value on any number of processes.",
                )
            )
    if not found:
        for i in range(steps):
            if many.samples(i) != one.samples(i):
                found.append(
                    Cause(
                        BLOCKING,
                        f"step {i + 1}: {nproc} processes saw {many.samples(i)} samples, one "
                        f"process {one.samples(i)}: drop_last or the sampler's padding (DistributedSampler "
                        "repeats samples to fill the last batch) changes what a step trains on.",
                    )
                )
                break
    return found


def _numeric_causes(many: Outcome, one: Outcome, nproc: int) -> list[Cause]:
    found: list[Cause] = []
    batchnorms = many.model.get("batchnorm_count", 0)
    if batchnorms and len(many.ranks) > 1:
        names = ", ".join(many.model.get("batchnorms", [])[:3])
        found.append(
            Cause(
                NUMERIC,
                f"{batchnorms} BatchNorm layer(s) ({names}) normalise with each rank's own batch: "
                "convert them with torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before run.setup, "
                "or expect this difference.",
            )
        )
    if min(many.most_steps, one.most_steps):
        a, b = many.loss(0), one.loss(0)
        if a and b and abs(a / b - 1 / nproc) < 0.02 / nproc:
            found.append(
                Cause(
                    NUMERIC,
                    f"step 1's loss on {nproc} processes is 1/{nproc} of one process's ({a:.6g} "
                    f"against {b:.6g}): the loss is summed over the batch (reduction='sum') or divided by "
                    f"the world size. Average it over the batch (reduction='mean'); DDP averages over ranks.",
                )
            )
        ratio = update_ratio(many, one, nproc)
        if ratio is not None:
            found.append(
                Cause(
                    NUMERIC,
                    f"the first update on {nproc} processes is {ratio:.3g}x one process's, in every "
                    "weight: gradients are scaled by the number of processes (an all-reduce SUM on top of "
                    "DDP's average, or a loss summed or divided by the world size). Let DDP average them.",
                )
            )
    return found


def _random_streams(many: Outcome) -> list[Cause]:
    steps = many.steps
    if len(many.ranks) < 2 or steps < 1:
        return []
    same = sum(
        1
        for i in range(steps)
        if len({tuple(r[i]["rng"]) for r in many.ranks}) == 1 and many.ranks[0][i]["rng"]
    )
    moved = sum(
        1
        for i in range(1, steps)
        if many.ranks[0][i]["rng"]
        and many.ranks[0][i - 1]["rng"]
        and many.ranks[0][i]["rng"][0] != many.ranks[0][i - 1]["rng"][-1]
    )
    dropouts = many.model.get("dropouts_disabled", 0)
    if same < max(1, steps // 2 + steps % 2) or not (dropouts or moved >= max(1, (steps - 1) // 2)):
        return []
    masks = (
        (
            f" The model has {dropouts} dropout layer(s) (off during the check): on {len(many.ranks)} processes "
            "they would draw the same masks on every rank."
        )
        if dropouts
        else ""
    )
    return [
        Cause(
            BLOCKING,
            "every rank draws the same random numbers at every step (a seed that is the same on every "
            "rank after mg.init, e.g. torch.manual_seed(1337) without the rank's offset): ranks repeat each "
            f"other's randomness.{masks} Seed through mg.init(seed=...) (per rank after run.setup) or add the "
            "rank to the seed.",
        )
    ]


def _gradient_sync(many: Outcome) -> list[Cause]:
    if len(many.ranks) < 2:
        return []
    never, last_off, bypass = [], [], 0
    for i in range(many.most_steps):
        for row in many.at(i):
            sync = [s for s in row.get("sync", []) if s is not None]
            if sync and not any(sync):
                never.append(i)
            elif sync and not sync[-1]:
                last_off.append(i)
            bypass += row.get("bypass", 0)
    found = []
    if never:
        found.append(
            Cause(
                BLOCKING,
                f"every forward pass of step(s) {_steps_text(sorted(set(never)))} ran under no_sync "
                "(require_backward_grad_sync False): those gradients were never averaged across ranks, so "
                "each rank stepped on its own data. Only the micro-steps before the last may skip the sync: "
                "`with run.no_sync(model):` around those, never around the last.",
            )
        )
    if last_off:
        found.append(
            Cause(
                BLOCKING,
                f"the last forward pass before optimizer step(s) {_steps_text(sorted(set(last_off)))} "
                "ran without gradient sync while an earlier one synced: the gradients that reach the optimizer "
                "are this rank's own. With nanoGPT's toggle, set `model.require_backward_grad_sync = "
                "(micro_step == gradient_accumulation_steps - 1)` - True on the last micro-step.",
            )
        )
    if bypass:
        found.append(
            Cause(
                BLOCKING,
                f"{bypass} forward pass(es) called the model around the object run.setup returned "
                "(model.module(x), or a reference kept from before run.setup): DDP does not average the "
                "gradients of those. Call the model that run.setup returned.",
            )
        )
    return found


def _outside_parameters(many: Outcome) -> list[Cause]:
    first = [r[0] for r in many.ranks if r]
    count = max((row.get("outside", 0) for row in first), default=0)
    if len(first) < 2 or not count or len({row.get("outside_digest") for row in first}) == 1:
        return []
    return [
        Cause(
            BLOCKING,
            f"{count} parameter tensor(s) the optimizer steps are not in the model given to run.setup, "
            "and they differ between ranks after step 1: their gradients are not averaged (a layer built after "
            "run.setup, or kept outside the model). Make them part of the model before run.setup, or set that "
            "module up with run.setup too.",
        )
    ]


def _diverged(many: Outcome, explained: bool) -> list[Cause]:
    if explained or len(many.ranks) < 2:
        return []
    for i in range(many.steps):
        digests = {r[i].get("weights_digest") for r in many.ranks}
        if None not in digests and len(digests) > 1:
            return [
                Cause(
                    BLOCKING,
                    f"the ranks' weights differ after step {i + 1}: the replicas drifted apart - "
                    "something changes the weights on some ranks only (an update outside the optimizer, a "
                    "rank-dependent branch, weights loaded on one rank after run.setup).",
                )
            ]
    return []


def _unused(many: Outcome, one: Outcome, nproc: int) -> list[Cause]:
    for outcome, label in ((many, f"{nproc} processes"), (one, "one process")):
        first = outcome.ranks[0][0] if outcome.ranks and outcome.ranks[0] else {}
        unused = first.get("no_grad") or []
        if unused:
            return [
                Cause(
                    BLOCKING,
                    f"{len(unused)} parameter(s) got no gradient in step 1 on {label} "
                    f"({', '.join(unused[:3])}): DDP fails at the next step unless run.setup(model, opt, "
                    "find_unused_parameters=True); or remove them from the model.",
                )
            ]
    return []


def _wrong_anyway(many: Outcome, one: Outcome) -> list[Cause]:
    found: list[Cause] = []
    rows = [row for outcome in (many, one) for r in outcome.ranks for row in r]
    clipped = sorted({row["step"] for row in rows if row.get("clipped_scaled")})
    if clipped:
        found.append(
            Cause(
                WRONG,
                f"gradients were clipped while still multiplied by the GradScaler's scale (step(s) "
                f"{', '.join(map(str, clipped[:5]))}: clip_grad_norm_ before scaler.unscale_(optimizer)): "
                "the threshold then applies to scaled gradients and clips far more than asked. Call "
                "scaler.unscale_(optimizer) before clipping.",
            )
        )
    per_step = sorted(
        {
            row["scheduler_steps"]
            for row in rows
            if row["step"] >= 2 and row.get("scheduler_steps", 0) > 1
        }
    )
    if per_step:
        found.append(
            Cause(
                WRONG,
                f"the LR scheduler stepped {per_step[-1]} times per optimizer step (once per "
                "micro-step): the schedule runs that many times too fast, and its speed changes with the "
                "accumulation. Step it once, after optimizer.step().",
            )
        )
    if len(many.ranks) > 1:
        last = [r[-1] for r in many.ranks if r]
        counts = {row.get("eval_samples", 0) for row in last}
        if any(row.get("averaged_scalars", 0) for row in last) and len(counts) > 1:
            found.append(
                Cause(
                    WRONG,
                    "a metric is averaged over the ranks' means (an all_reduce with ReduceOp.AVG) while "
                    f"ranks evaluated {' and '.join(str(c) for c in sorted(counts))} samples: the mean of "
                    "means is not the mean. All-reduce sums and counts (run.metric_sums()) instead.",
                )
            )
    return found


def diagnose(many: Outcome, one: Outcome, nproc: int) -> list[Cause]:
    """Every cause the records support, most basic first."""
    sync, outside, rank_steps, unused = (
        _gradient_sync(many),
        _outside_parameters(many),
        _rank_steps(many),
        _unused(many, one, nproc),
    )
    # each of these makes the replicas drift apart
    explained = bool(sync or outside or rank_steps or unused)
    return (
        rank_steps
        + _identical_inputs(many)
        + _batch_causes(many, one, nproc)
        + _numeric_causes(many, one, nproc)
        + _random_streams(many)
        + sync
        + outside
        + _diverged(many, explained)
        + unused
        + _wrong_anyway(many, one)
    )


def unverified(many: Outcome, one: Outcome, nproc: int) -> list[str]:
    """Why an agreement of the numbers proves nothing: what each step trained on was not seen."""
    reasons = []
    for outcome, label in ((many, f"{nproc}-process"), (one, "1-process")):
        empty = [
            i for i in range(outcome.steps) if any(row["samples"] == 0 for row in outcome.at(i))
        ]
        if empty:
            reasons.append(
                f"no sample was counted in step(s) {_steps_text(empty)} of the {label} run: the model "
                "given to run.setup was not called with tensors (or not called at all), so what the step "
                "trained on is unknown. Call the model run.setup returned, with the batch's tensors."
            )
    if len(many.ranks) > 1:
        blind = [i for i in range(many.steps) if any(not any(row["inputs"]) for row in many.at(i))]
        if blind and not reasons:
            reasons.append(
                f"the ranks' inputs could not be compared in step(s) {_steps_text(blind)}: no tensor "
                "reached the model's forward, so whether the data is split across ranks is unknown."
            )
    return reasons + trained_nothing(one)


def trained_nothing(one: Outcome) -> list[str]:
    """Why two runs that agree may prove nothing: the training did not move. Weights equal before and
    after every step agree on any number of processes (a loss that is always 0, a learning rate of 0,
    an optimizer given other parameters); so does a loss that never changed, with any bug in the
    reduction (0 summed over ranks is 0). Read from the 1-process run, the reference."""
    reasons = []
    before, after = one.weights("weights0.pt"), one.weights("weights.pt")
    if before and after and set(before) == set(after):
        rows = weight_differences(after, before)
        if rows and all(diff == 0.0 for _, diff, _ in rows):
            reasons.append(
                f"no weight changed in {one.steps} step(s) ({len(rows)} tensor(s) bitwise equal before and "
                "after): equal numbers on any number of processes prove nothing. Check that the loss "
                "depends on the model's output, the learning rate is not 0, and the optimizer holds the "
                "model's parameters; or run more --steps."
            )
    losses = [one.loss(i) for i in range(one.steps)]
    if len(losses) >= 2 and losses[0] is not None and all(loss == losses[0] for loss in losses):
        reasons.append(
            f"the loss was {losses[0]:.6g} at every one of {len(losses)} steps: a loss that does not move "
            "hides a wrong reduction (a summed or unscaled loss agrees when it is constant). Check the "
            "loss, or run more --steps."
        )
    return reasons


# ------------------------------------------------------------------------------------------ the command
