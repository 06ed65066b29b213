"""The queue's status table (live on a terminal, one line per event in a log) and the final summary.

rich draws the tables: it is already how Python tools print tables that survive both a terminal and
a log file, and it redraws a live table without flicker.
"""

from __future__ import annotations

import json
import shlex
import time
from typing import Optional

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from multigpu.errors import MultiGPUError, visible
from multigpu.fileio import Folder
from multigpu.loggers import read_csv
from multigpu.queue.run_folder import log_tail
from multigpu.queue.scheduler import EntryState, Queue
from multigpu.trainer.progress import PROGRESS_FILE, format_duration

STYLE = {
    "queued": "dim",
    "running": "bold cyan",
    "done": "green",
    "skipped": "green",
    "failed": "bold red",
    "interrupted": "yellow",
}


def last_metrics(run: EntryState) -> dict[str, str]:
    """The final metrics of a run: its final.json if the recipe wrote one, else the last metrics.csv row.

    These files are written by the recipe (or by whoever wrote the folder): anything unreadable or of
    the wrong shape counts as "no metrics", never as a crash of the queue's display.
    """
    folder = Folder(run.folder)
    try:
        values = json.loads(folder.load_text("final.json", limit=1 << 20))
    except (OSError, ValueError, RecursionError):
        values = None
    if isinstance(values, dict):
        return {
            visible(str(k))[:40]: f"{v:.4g}" if isinstance(v, float) else visible(str(v))[:40]
            for k, v in list(values.items())[:50]
        }
    try:
        last = read_csv(run.folder / "metrics.csv")[-1:]
    except (OSError, MultiGPUError):
        return {}
    return {
        visible(k)[:40]: visible(str(v))[:40]
        for k, v in (last[0] if last else {}).items()
        if isinstance(k, str) and v is not None
    }


def headline(run: EntryState) -> str:
    """One metric for the status table: the run's chosen one, else the first validation metric."""
    values = last_metrics(run)
    if not values:
        return ""
    key = (
        run.spec.metric
        if run.spec.metric in values
        else next(
            (k for k in values if k.startswith("valid_")),
            next((k for k in ("accuracy", "loss", "train_loss") if k in values), None),
        )
    )
    if key is None:
        return ""
    value = values[key]
    try:
        value = f"{float(value):.4g}"
    except ValueError:
        pass
    return f"{key} {value}"


def _elapsed(run: EntryState) -> str:
    seconds = run.elapsed
    if seconds is None:
        return ""
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}" if seconds >= 60 else f"{seconds:.1f} s"


def progress(run: EntryState) -> str:
    """A running run's step and ETA, from the ``progress.json`` its Trainer keeps in its folder
    (``multigpu.trainer.progress``); written by the run, so read as untrusted: anything else is ''."""
    if run.state != "running":
        return ""
    try:
        values = json.loads(Folder(run.folder).load_text(PROGRESS_FILE, limit=4096))
    except (OSError, ValueError, RecursionError):
        return ""
    if not isinstance(values, dict):
        return ""

    def count(key: str) -> Optional[int]:
        value = values.get(key)
        return (
            value
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**15
            else None
        )

    done, of, epoch, epochs = count("done"), count("of"), count("epoch"), count("epochs")
    eta = values.get("eta_s")
    parts = []
    if epoch is not None and epochs is not None and values.get("counts") != "steps":
        parts.append(f"epoch {epoch}/{epochs}")
    if done is not None and of:
        parts.append(f"{'step ' if values.get('counts') == 'steps' else ''}{done}/{of}")
    if isinstance(eta, (int, float)) and not isinstance(eta, bool) and 0 <= eta < 10**9:
        parts.append(f"ETA {format_duration(eta)}")
    return " ".join(parts)


def where(run: EntryState) -> str:
    """'0,1', or '0 (1/4)' for a run on a share of GPU 0."""
    return ",".join(run.slots) + (f" ({run.share})" if run.share < 1 and run.slots else "")


def status_table(queue: Queue) -> Table:
    unit = "GPUs" if queue.on_gpus else "slots"
    table = Table(title=Text(f"multigpu queue: {queue.root}"), title_justify="left")
    for column in ("run", "state", unit, "elapsed", "progress", "last metric", "note"):
        table.add_column(column)
    for run in queue.runs:  # user strings as Text: never read as rich markup
        table.add_row(
            Text(run.spec.name),
            Text(run.state, style=STYLE[run.state]),
            Text(where(run)),
            _elapsed(run),
            Text(progress(run)),
            Text(headline(run)),
            Text(run.note),
        )
    return table


#: Columns a table may take in a log file or a pipe: whole names and metrics on one line, for grep.
LOG_WIDTH = 400


def console_for_output() -> Console:
    """The queue's console: the terminal's width on a terminal; in a log file or a pipe (a Slurm log, `|
    tee`) one wide enough that no name is cut and no metric wraps onto the next line (rich's default there
    is 80 columns)."""
    console = Console()
    return console if console.is_terminal else Console(width=LOG_WIDTH, force_terminal=False)


class Display:
    """Callable given to :class:`Queue`: live table on a terminal, event lines otherwise."""

    def __init__(
        self, console: Optional[Console] = None, live: Optional[bool] = None, refresh_s: float = 0.5
    ) -> None:
        self.console = console or console_for_output()
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
        place = f" on {'GPU' if queue.on_gpus else 'slot'} {where(run)}" if state == "start" else ""
        if state == "skipped":
            extra = f" - {run.note}" if run.note else ""
        elif state != "start":
            extra = f" after {_elapsed(run)} (exit {run.exit_code}) {headline(run)}"
        else:
            extra = f" ({run.note})" if run.note else ""
        self.console.print(
            f"[queue] {state} {name}{place}{extra}".rstrip(),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )  # one line per event, however long

    def summary(self, queue: Queue) -> None:
        table = Table(title="summary", title_justify="left")
        metric_names: list[str] = []
        finals = {run.spec.name: last_metrics(run) for run in queue.runs}
        for values in finals.values():
            metric_names += [
                k
                for k in values
                if k not in metric_names and k not in ("epoch", "step", "lr", "epoch_s")
            ]
        notes = any(run.note for run in queue.runs)
        for column in ("run", "state", "elapsed", *metric_names, *(["note"] if notes else [])):
            table.add_column(Text(column))
        for run in queue.runs:
            values = finals[run.spec.name]
            table.add_row(
                Text(run.spec.name),
                Text(run.state, style=STYLE[run.state]),
                _elapsed(run),
                *[Text(_short(values.get(k, ""))) for k in metric_names],
                *([Text(run.note)] if notes else []),
            )
        self.console.print(table)
        for run in queue.runs:
            if run.state == "failed" and run.note.startswith("not started"):
                self.console.print(Text(f"{run.spec.name} {run.note}", style="bold red"))
            elif run.state == "failed":
                self.console.print(
                    f"[bold red]{escape(run.spec.name)} failed (exit {run.exit_code}); last lines of "
                    f"{escape(str(run.folder / 'log.txt'))}:[/]"
                )
                for line in log_tail(run.folder):
                    self.console.print(f"    {line}", highlight=False, markup=False)
        best = best_line(queue)
        if best:
            self.console.print(best, highlight=False, markup=False)
        span, work = queue.makespan()
        if span:
            ideal = work / len(queue.slots)
            self.console.print(
                f"makespan {span:.1f} s for {work:.1f} s of runs on {len(queue.slots)} "
                f"{'GPU(s)' if queue.on_gpus else 'slot(s)'} (ideal {ideal:.1f} s, "
                f"{ideal / span:.0%} of it)",
                highlight=False,
            )


def best_line(queue: Queue) -> str:
    """'best run: NAME (valid_accuracy 0.97, highest of 4); curves of every run: multigpu plot OUT' - or ''.

    The metric and its direction are the runs file's ``metric:`` and ``mode:`` (when the runs agree), else
    valid_loss, else the ``loss`` of a recipe's final.json, lower being better - never guessed from a name."""
    finals = {run.spec.name: last_metrics(run) for run in queue.runs if run.state == "done"}
    chosen = {(run.spec.metric, run.spec.mode) for run in queue.runs if run.spec.metric}
    columns = {k for values in finals.values() for k in values}
    key: Optional[str]  # None: nothing to rank by
    if len(chosen) == 1:
        key, mode = chosen.pop()
    else:
        key, mode = next((k for k in ("valid_loss", "loss") if k in columns), None), "min"
    if key is None:
        return ""
    scored = []
    for name, values in finals.items():
        try:
            scored.append((float(values[key]), name))
        except (KeyError, TypeError, ValueError):
            continue
    scored = [(v, n) for v, n in scored if v == v]  # drop NaN
    if not key or not scored:
        return ""
    value, name = (max if mode == "max" else min)(scored)
    return (
        f"best run: {name} ({key} {value:.4g}, {'highest' if mode == 'max' else 'lowest'} of {len(scored)}); "
        f"curves of every run: multigpu plot {shlex.quote(str(queue.root))}"
    )


def _short(value: str) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return str(value)
