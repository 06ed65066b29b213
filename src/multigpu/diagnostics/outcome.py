"""What one run of ``multigpu check`` left, read back, and how its numbers compare with the other run's.

Why apart from the causes (:mod:`multigpu.diagnostics.causes`): reading the per-rank step records and
the weights, and measuring a difference against a tolerance, is the evidence; the causes reason over
it. Pure functions and one record class, tested against recorded cases without launching anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from multigpu import validate
from multigpu.fileio import Folder

EPS = {"float32": 1.2e-7, "float64": 2.2e-16, "bfloat16": 7.8e-3, "float16": 9.8e-4}


@dataclass
class Outcome:
    """What one run of the script left: per-rank step records, the layers found, the weights."""

    folder: Path
    status: int
    output: str
    ranks: list[list[dict[str, Any]]] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=dict)
    stranded: list[int] = field(default_factory=list)

    @classmethod
    def read(cls, folder: Path, status: int, output: str) -> "Outcome":
        # written by the runs the check started, in its own temporary folder
        records = Folder(folder)
        ranks = []
        for path in sorted(
            folder.glob("rank*.jsonl"),
            key=lambda p: int(p.stem[4:]) if validate.is_digits(p.stem[4:]) else -1,
        ):
            lines = [
                line
                for line in records.load_text(path.name, limit=256 << 20).splitlines()
                if line.strip()
            ]
            ranks.append([json.loads(line) for line in lines])
        model = (
            json.loads(records.load_text("model.json"))
            if records.kind("model.json") == "file"
            else {}
        )
        stranded = sorted(
            {
                r
                for path in folder.glob("stranded.rank*.json")
                for r in json.loads(records.load_text(path.name)).get("missing", [])
            }
        )
        return cls(folder, status, output, ranks, model, stranded)

    @property
    def steps(self) -> int:
        """Steps every rank recorded."""
        return min((len(r) for r in self.ranks), default=0)

    @property
    def most_steps(self) -> int:
        return max((len(r) for r in self.ranks), default=0)

    def at(self, step: int) -> list[dict[str, Any]]:
        """The records of step ``step`` (0-based) of the ranks that got that far."""
        return [r[step] for r in self.ranks if len(r) > step]

    def weights(self, name: str = "weights.pt") -> Optional[dict[str, Any]]:
        import torch

        records = Folder(self.folder)
        if records.kind(name) != "file":
            return None
        with records.open_read(name) as handle:
            loaded: dict[str, Any] = torch.load(handle, map_location="cpu", weights_only=True)
            return loaded

    def loss(self, step: int) -> Optional[float]:
        """The global loss of a step: each rank's (the sum of the values it gave to backward in the
        step, i.e. the script's own loss when it divides by its accumulation) weighted by its samples."""
        rows = [row for row in self.at(step) if row.get("loss") is not None]
        if not rows:
            return None
        total = sum(row["samples"] for row in rows)
        mean: float = (
            sum(row["loss"] for row in rows) / len(rows)
            if total == 0
            else sum(row["loss"] * row["samples"] for row in rows) / total
        )
        return mean

    def samples(self, step: int) -> int:
        return sum(row["samples"] for row in self.at(step))

    def error_line(self) -> str:
        lines = [line for line in self.output.splitlines() if "error" in line.lower()]
        return (
            lines[-1] if lines else (self.output.strip().splitlines() or ["(no output)"])[-1]
        ).strip()[:300]


#: The default tolerance never exceeds this: a summed loss (1/N), doubled gradients (N x) or BatchNorm
#: drift must stay visible under bf16/fp16 autocast, whose eps alone would allow several times the value.
MAX_TOLERANCE = 2e-2


def tolerance_for(dtype: Optional[str], steps: int, given: Optional[float]) -> float:
    if given is not None:
        return given
    return min(
        MAX_TOLERANCE, 500 * EPS.get(dtype or "float32", EPS["float32"]) * math.sqrt(max(steps, 1))
    )


def finite_or_inf(value: float) -> float:
    """A NaN difference (a run that diverged) must never look small: max() would skip it."""
    return value if math.isfinite(value) else math.inf


def weight_differences(many: dict[str, Any], one: dict[str, Any]) -> list[tuple[str, float, float]]:
    rows = []
    for name in sorted(set(many) | set(one)):
        if name not in many or name not in one or many[name].shape != one[name].shape:
            rows.append((name, math.inf, math.inf))
            continue
        a, b = many[name].double(), one[name].double()
        diff = finite_or_inf((a - b).abs().max().item()) if a.numel() else 0.0
        scale = b.abs().max().item() if b.numel() else 0.0
        rows.append((name, diff, finite_or_inf(diff / scale) if scale > 0 else diff))
    return rows


def update_ratio(many: Outcome, one: Outcome, nproc: int) -> Optional[float]:
    """N or 1/N when the first update of every weight tensor on N processes is that multiple of one
    process's (gradients scaled by the world size); None otherwise. Per tensor, so that an update that
    differs for another reason cannot average out to N by chance."""
    m0, m1 = many.weights("weights0.pt"), many.weights("weights1.pt")
    o0, o1 = one.weights("weights0.pt"), one.weights("weights1.pt")
    if not (m0 and m1 and o0 and o1):
        return None
    ratios = []
    for k in m0:
        if (
            k in m1
            and k in o0
            and k in o1
            and m1[k].is_floating_point()
            and m1[k].shape == o1[k].shape
        ):
            num = (m1[k].double() - m0[k].double()).norm().item()
            den = (o1[k].double() - o0[k].double()).norm().item()
            if den > 0:
                ratios.append(num / den)
    for factor in (nproc, 1 / nproc):
        if ratios and all(abs(r - factor) < 0.05 * factor for r in ratios):
            return factor
    return None


def batch_shape(outcome: Outcome, step: int = 0) -> str:
    """'2 processes x 1 micro-step x 8 samples = 16' for one step of a run, from its records."""
    rows = outcome.at(step)
    if not rows:
        return "no step recorded"
    forwards = {row["forwards"] for row in rows}
    sizes = {size for row in rows for size in row["rows"]}
    micro = (
        str(forwards.pop())
        if len(forwards) == 1
        else "/".join(str(row["forwards"]) for row in rows)
    )
    each = str(sizes.pop()) if len(sizes) == 1 else "+".join(str(s) for s in sorted(sizes))
    procs = f"{len(rows)} process{'es' if len(rows) > 1 else ''}"
    missing = [str(r) for r, records in enumerate(outcome.ranks) if len(records) <= step]
    if missing:
        procs += f" (rank(s) {', '.join(missing)}: no step)"
    if not any(row["rows"] for row in rows) or not outcome.samples(step):
        return f"{procs} x {micro} micro-step(s), no sample counted"
    return f"{procs} x {micro} micro-step(s) x {each} samples = {outcome.samples(step)}"
