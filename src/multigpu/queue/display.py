"""The queue's status table (live on a terminal, one line per event in a log) and the final summary.

rich draws the tables: it is already how Python tools print tables that survive both a terminal and
a log file, and it redraws a live table without flicker.
"""

from __future__ import annotations

import csv
import json
import time
from typing import Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table

from multigpu.queue.scheduler import Queue, RunState, log_tail

STYLE = {"queued": "dim", "running": "bold cyan", "done": "green", "skipped": "green", "failed": "bold red",
         "interrupted": "yellow"}


def last_metrics(run: RunState) -> dict[str, str]:
    """The final metrics of a run: its final.json if the recipe wrote one, else the last metrics.csv row."""
    final = run.folder / "final.json"
    if final.exists():
        try:
            return {k: f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in json.loads(final.read_text()).items()}
        except (OSError, ValueError):
            pass
    path = run.folder / "metrics.csv"
    try:
        with open(path, newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError:
        return {}
    return dict(rows[-1]) if rows else {}


def headline(run: RunState) -> str:
    """One metric for the status table: the run's chosen one, else the first validation metric."""
    values = last_metrics(run)
    if not values:
        return ""
    key = run.spec.metric if run.spec.metric in values else next(
        (k for k in values if k.startswith("valid_")), next((k for k in ("accuracy", "loss", "train_loss") if k in values), None))
    if key is None:
        return ""
    value = values[key]
    try:
        value = f"{float(value):.4g}"
    except ValueError:
        pass
    return f"{key} {value}"


def _elapsed(run: RunState) -> str:
    seconds = run.elapsed
    if seconds is None:
        return ""
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}" if seconds >= 60 else f"{seconds:.1f} s"


def status_table(queue: Queue) -> Table:
    unit = "GPUs" if queue.on_gpus else "slots"
    table = Table(title=f"multigpu queue: {queue.root}", title_justify="left")
    for column in ("run", "state", unit, "elapsed", "last metric", "note"):
        table.add_column(column)
    for run in queue.runs:
        table.add_row(run.spec.name, f"[{STYLE[run.state]}]{run.state}[/]", ",".join(run.slots), _elapsed(run),
                      headline(run), run.note)
    return table


class Display:
    """Callable given to :class:`Queue`: live table on a terminal, event lines otherwise."""

    def __init__(self, console: Optional[Console] = None, live: Optional[bool] = None, refresh_s: float = 0.5) -> None:
        self.console = console or Console()
        self.live_enabled = self.console.is_terminal if live is None else live
        self.refresh_s = refresh_s
        self._live: Optional[Live] = None
        self._last = 0.0

    def __call__(self, queue: Queue, event: str) -> None:
        if self.live_enabled:
            if self._live is None:
                self._live = Live(status_table(queue), console=self.console, auto_refresh=False)
                self._live.start()
            now = time.monotonic()
            if event != "tick" or now - self._last >= self.refresh_s:
                self._last = now
                self._live.update(status_table(queue), refresh=True)
            if event == "end":
                self._live.stop()
                self._live = None
            return
        if event == "tick":
            return
        if event == "end":
            return
        state, name = event.split(" ", 1)
        run = next(r for r in queue.runs if r.spec.name == name)
        where = f" on {'GPU' if queue.on_gpus else 'slot'} {','.join(run.slots)}" if state == "start" else ""
        extra = f" after {_elapsed(run)} (exit {run.exit_code}) {headline(run)}" if state != "start" else ""
        self.console.print(f"[queue] {state} {name}{where}{extra}".rstrip(), highlight=False, markup=False)

    def summary(self, queue: Queue) -> None:
        table = Table(title="summary", title_justify="left")
        metric_names: list[str] = []
        finals = {run.spec.name: last_metrics(run) for run in queue.runs}
        for values in finals.values():
            metric_names += [k for k in values if k not in metric_names and k not in ("epoch", "step", "lr", "epoch_s")]
        for column in ("run", "state", "elapsed", *metric_names):
            table.add_column(column)
        for run in queue.runs:
            values = finals[run.spec.name]
            table.add_row(run.spec.name, f"[{STYLE[run.state]}]{run.state}[/]", _elapsed(run),
                          *[_short(values.get(k, "")) for k in metric_names])
        self.console.print(table)
        for run in queue.runs:
            if run.state == "failed":
                self.console.print(f"[bold red]{run.spec.name} failed (exit {run.exit_code}); last lines of "
                                   f"{run.folder / 'log.txt'}:[/]")
                for line in log_tail(run.folder):
                    self.console.print(f"    {line}", highlight=False, markup=False)
        span, work = queue.makespan()
        if span:
            ideal = work / len(queue.slots)
            self.console.print(f"makespan {span:.1f} s for {work:.1f} s of runs on {len(queue.slots)} "
                               f"{'GPU(s)' if queue.on_gpus else 'slot(s)'} (ideal {ideal:.1f} s, "
                               f"{ideal / span:.0%} of it)", highlight=False)


def _short(value: str) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return str(value)
