"""A sweep's trials as queue runs, the queue's half of the trial channel, and the family's ranking.

A :class:`Trial` is a run like any other (its folder, lock, status, resume and skip) that also knows
its family and its values, and gets a channel to the queue: ``OUT/<trial>/trial/`` with the settings
the queue writes (the metric to report, how long to wait for an answer), the ``reports.csv`` rank 0
appends after each evaluation (:mod:`multigpu.guards.trial`) and the ``verdict.json`` the search
answers with. Everything read back here is data from disk: bounded, checked, and anything malformed
counts as "not reported", never as a crash of the queue.

The ranking follows the family's ``metric`` and ``mode`` (never a guess from the metric's name); a
trial's value is the last value it reported (its last evaluation), else its final metrics. The
summary prints the ranking and the best settings; ``OUT/.sweeps/<family>.json`` keeps it for
``multigpu plot OUT``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.table import Table
from rich.text import Text

from multigpu.distributed.job import TRIAL_REPORTS_FILE, TRIAL_SETTINGS_FILE, TRIAL_VERDICT_FILE
from multigpu.errors import MultiGPUError, visible
from multigpu.fileio import Folder
from multigpu.loggers import read_csv
from multigpu.queue.runs import QueueEntry
from multigpu.queue.space import Space
from multigpu.queue.trial_names import value_text

#: In a trial's folder: its channel to the queue (its job's trial_dir).
TRIAL_FOLDER = "trial"
#: In the queue's folder: each family's record and each search's study (no run name starts with a dot).
SWEEPS_FOLDER = ".sweeps"
#: How long rank 0 of a pruned-search trial waits for the queue's answer to one report. The local queue
#: answers within its poll (0.1 s); a longer silence means the queue is gone, and the trial goes on.
VERDICT_WAIT_S = 60.0
#: Rows of the summary's ranking (the record and the plot keep every trial).
SHOWN = 10


@dataclass
class Trial(QueueEntry):
    """One trial of a sweep or search: a run of its family's settings with ``values`` as overrides."""

    family: str = ""
    values: dict[str, Any] = field(default_factory=dict)
    #: How long rank 0 waits for the search's answer to each report (0: no pruner, no wait).
    wait_s: float = 0.0

    def fingerprint(self) -> str:
        """The same as the plain run with these settings: where a run came from does not change it."""
        return QueueEntry(
            **{f.name: getattr(self, f.name) for f in fields(QueueEntry)}
        ).fingerprint()

    def job_changes(self, folder: Path) -> dict[str, Any]:
        return {"trial_dir": str(Path(folder) / TRIAL_FOLDER)}

    def prepare(self, folder: Path) -> None:
        settings = {"metric": self.metric or "valid_loss", "wait_s": self.wait_s}
        Folder(folder).create().write_atomic(
            f"{TRIAL_FOLDER}/{TRIAL_SETTINGS_FILE}", json.dumps(settings)
        )


def make_trial(
    family: QueueEntry, name: str, values: dict[str, Any], space: Space, wait_s: float = 0.0
) -> Trial:
    """A trial of ``family``: every setting of it, ``values`` on top of its overrides."""
    settings = {f.name: getattr(family, f.name) for f in fields(QueueEntry)}
    settings.update(
        name=name,
        overrides={**family.overrides, **values},
        env=dict(family.env),
        args=list(family.args),
        metric=space.metric,
    )
    if "mode" in settings:  # the runs file's direction for the status table and the best-run line
        settings["mode"] = space.mode
    return Trial(**settings, family=family.name, values=dict(values), wait_s=wait_s)


# ------------------------------------------------------------------------- the queue's side


def read_reports(folder: Path) -> list[tuple[int, float]]:
    """(step, value) of each report, steps increasing (a repeated or earlier step - a resumed trial
    reporting again - is dropped); [] when there are none or the file cannot be read safely."""
    try:
        rows = read_csv(Path(folder) / TRIAL_FOLDER / TRIAL_REPORTS_FILE)
    except (OSError, MultiGPUError):
        return []
    out: list[tuple[int, float]] = []
    for row in rows:
        try:
            step, value = int(row.get("step") or ""), float(row.get("value") or "")
        except ValueError:
            continue
        if step >= 0 and (not out or step > out[-1][0]):
            out.append((step, value if math.isfinite(value) else math.nan))
    return out


def read_verdict(folder: Path) -> Optional[tuple[int, bool]]:
    """(latest step answered, pruned) as the queue wrote it; None when there is no answer yet."""
    try:
        data = json.loads(
            Folder(Path(folder) / TRIAL_FOLDER).load_text(TRIAL_VERDICT_FILE, limit=4096)
        )
    except (OSError, ValueError):
        return None
    step, prune = (data.get("step"), data.get("prune")) if isinstance(data, dict) else (None, None)
    if isinstance(step, int) and not isinstance(step, bool) and isinstance(prune, bool):
        return step, prune
    return None


def write_verdict(folder: Path, step: int, prune: bool) -> None:
    """Answer every report up to ``step``; ``prune`` stays true once given (every rank reads the same)."""
    Folder(Path(folder) / TRIAL_FOLDER).write_atomic(
        TRIAL_VERDICT_FILE, json.dumps({"step": step, "prune": prune})
    )


@dataclass(frozen=True)
class Result:
    #: The last value reported, else the metric in its final metrics; None: nothing (or NaN).
    value: Optional[float]
    pruned: bool
    reports: int


def result(folder: Path, metric: str) -> Result:
    """What a trial's folder says about it."""
    reports = read_reports(folder)
    verdict = read_verdict(folder)
    value = reports[-1][1] if reports else final_value(folder, metric)
    if value is not None and not math.isfinite(value):
        value = None
    return Result(value, bool(verdict and verdict[1]), len(reports))


def final_value(folder: Path, metric: str) -> Optional[float]:
    """``metric`` in the last metrics.csv row that has it, else in final.json (a recipe that reports nothing)."""
    try:
        rows = read_csv(Path(folder) / "metrics.csv")
    except (OSError, MultiGPUError):
        rows = []
    for row in reversed(rows):
        number = _number(row.get(metric))
        if number is not None:
            return number
    try:
        data = json.loads(Folder(folder).load_text("final.json", limit=1 << 20))
    except (OSError, ValueError, RecursionError):
        return None
    return _number(data.get(metric)) if isinstance(data, dict) else None


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


# ------------------------------------------------------------------------- the ranking


@dataclass
class Row:
    name: str
    values: dict[str, Any]
    #: done, pruned, failed, interrupted, running, queued
    state: str
    value: Optional[float]
    reports: int
    note: str = ""


def rows_of(runs: Sequence[Any], family: str, metric: str) -> list[Row]:
    """The family's trials among the queue's runs (anything with ``spec``, ``folder`` and ``state``)."""
    rows = []
    for run in runs:
        spec = run.spec
        if not isinstance(spec, Trial) or spec.family != family:
            continue
        found = result(run.folder, metric)
        state = {"skipped": "done"}.get(run.state, run.state)
        if state == "done" and found.pruned:
            state = "pruned"
        rows.append(Row(spec.name, dict(spec.values), state, found.value, found.reports, run.note))
    return rows


def ranked(rows: Sequence[Row], mode: str) -> list[Row]:
    """Finished trials best first by their value (``mode``: min or max), then pruned ones (best first),
    then trials without a value or still unfinished."""
    sign = -1.0 if mode == "max" else 1.0

    def key(row: Row) -> tuple[Any, ...]:
        group = {"done": 0, "pruned": 1}.get(row.state, 2) if row.value is not None else 3
        return group, sign * row.value if row.value is not None else 0.0

    return sorted(rows, key=key)


def best_settings(family: str, space: Space, rows: Sequence[Row]) -> str:
    """'best of lr_grid: optim.lr=0.003 model.hidden=64 (lr_grid-lr0.003-hidden64, valid_loss 0.31, lowest
    of 4 finished; 2 pruned)' - or a line saying there is none yet."""
    order = ranked(rows, space.mode)
    finished = [r for r in order if r.state == "done" and r.value is not None]
    pruned = sum(1 for r in rows if r.state == "pruned")
    tail = f"; {pruned} pruned" if pruned else ""
    if not finished:
        return visible(
            f"{family}: no trial finished with a {space.metric} yet ({len(rows)} trial(s){tail})"
        )
    best = finished[0]
    settings = " ".join(f"{k}={value_text(v)}" for k, v in best.values.items())
    word = "highest" if space.mode == "max" else "lowest"
    return visible(
        f"best of {family}: {settings} ({best.name}, {space.metric} {best.value:.4g}, {word} of "
        f"{len(finished)} finished{tail})"
    )  # values read back from files: terminal-safe


def ranking_table(family: str, space: Space, rows: Sequence[Row]) -> Table:
    order = ranked(rows, space.mode)
    kind = (
        f"search ({space.search.sampler}, pruner {space.search.pruner})"
        if space.search
        else "sweep"
    )
    table = Table(
        title=Text(f"{kind} {family}: {len(rows)} trial(s) by {space.metric} ({space.mode})"),
        title_justify="left",
    )
    keys = [p.key for p in space.params]
    for column in ("#", "trial", "state", space.metric, "reports", *keys):
        table.add_column(Text(column))
    for index, row in enumerate(order[:SHOWN], start=1):
        value = "" if row.value is None else f"{row.value:.4g}"
        table.add_row(
            str(index),
            Text(row.name),
            Text(row.state),
            value,
            str(row.reports),
            *[Text(value_text(row.values.get(k), short=True)) for k in keys],
        )
    if len(order) > SHOWN:
        table.add_row(
            "",
            Text(f"... {len(order) - SHOWN} more (all in {SWEEPS_FOLDER}/{family}.json)"),
            "",
            "",
            "",
            *["" for _ in keys],
        )
    return table


def write_record(root: Path, family: str, space: Space, rows: Sequence[Row]) -> Path:
    """``OUT/.sweeps/<family>.json``: the space and every trial ranked - what ``multigpu plot`` draws."""
    order = ranked(rows, space.mode)
    record = {
        "family": family,
        "metric": space.metric,
        "mode": space.mode,
        "kind": f"search:{space.search.sampler}" if space.search else "sweep",
        "params": {p.key: p.record() for p in space.params},
        "trials": [
            {
                "run": r.name,
                "values": r.values,
                "state": r.state,
                "value": r.value,
                "reports": f"{r.name}/{TRIAL_FOLDER}/{TRIAL_REPORTS_FILE}",
            }
            for r in order
        ],
    }
    folder = Folder(root).child(SWEEPS_FOLDER)
    folder.write_atomic(f"{family}.json", json.dumps(record, indent=1, default=str))
    return folder / f"{family}.json"


def shown_values(values: dict[str, Any]) -> str:
    return visible(" ".join(f"{k}={value_text(v)}" for k, v in values.items()))[:200]


def _left_out(runs: Sequence[Any], root: Path, every: Sequence[Trial]) -> list[Any]:
    """Trials of the family this queue did not run (``--only``) but that ran before: as their folders say."""
    from types import SimpleNamespace

    from multigpu.queue.run_folder import read_status

    here = {run.spec.name for run in runs}
    out = []
    for trial in every:
        if trial.name not in here:
            status = read_status(Path(root) / trial.name)
            if status.get("state"):
                out.append(
                    SimpleNamespace(
                        spec=trial, folder=Path(root) / trial.name, state=status["state"], note=""
                    )
                )
    return out


def summarize(console: Any, runs: Sequence[Any], root: Path, families: Sequence[Any]) -> None:
    """After the queue: each family's ranking and best settings, and its record for ``multigpu plot``."""
    import shlex

    from rich.console import Console

    from multigpu.queue.display import LOG_WIDTH

    if not console.is_terminal:  # a log file or a pipe: whole trial names, not 80 columns
        console = Console(
            width=max(console.width, LOG_WIDTH), file=console.file, force_terminal=False
        )
    for family in families:
        rows = rows_of(
            [*runs, *_left_out(runs, root, getattr(family, "every", []))],
            family.name,
            family.space.metric,
        )
        if not rows:
            continue
        console.print(ranking_table(family.name, family.space, rows))
        console.print(
            best_settings(family.name, family.space, rows),
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        write_record(root, family.name, family.space, rows)
        console.print(
            f"curves of the best trials, and {family.space.metric} against each swept value: "
            f"multigpu plot {shlex.quote(str(root))}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
