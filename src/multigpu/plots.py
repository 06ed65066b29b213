"""Loss curves as PNG, from the CSV files a run writes: ``multigpu plot OUT...`` and ``curves.png``.

Why from the files: a run folder - or a queue folder full of them - is all there is after training,
on a laptop or a cluster's login node, with no TensorBoard server. Several runs are overlaid in one
figure, labelled by folder name. matplotlib is optional (the ``plot`` extra): without it the Trainer
skips ``curves.png`` and the command says how to install it. Drawn with matplotlib's object API on
its Agg canvas, so no global pyplot state and no display is needed.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from multigpu.errors import ConfigError, shown, visible
from multigpu.fileio import Folder
from multigpu.loggers import CSV_FILES, read_csv

if TYPE_CHECKING:
    from matplotlib.axes import Axes

SIZE_IN = (11.0, 4.0)
DPI = 100


def is_run(folder: Path) -> bool:
    return any((folder / name).is_file() for name in CSV_FILES.values())


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Run folders: each path that holds metrics.csv/steps.csv, or the runs inside it (a queue folder)."""
    runs: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise ConfigError(
                f"{path} is not a folder.", "give a run's out_dir or a queue's --out folder."
            )
        if is_run(path):
            runs.append(path)
            continue
        inside = sorted(
            p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".") and is_run(p)
        )
        if not inside:
            raise ConfigError(
                f"{path} holds no metrics.csv or steps.csv (nor do its subfolders).",
                "give the folder a run wrote into (its trainer.out_dir).",
            )
        runs.extend(inside)
    return runs


#: Steps and values beyond this are not plotted (a forged 1e308 would make no axis at all).
MAX_ABS = 1e15


def _series(rows: list[dict[str, str]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        try:
            x, y = float(row.get("step") or "nan"), float(row.get(key) or "nan")
        except (ValueError, TypeError):
            continue
        if math.isfinite(x) and math.isfinite(y) and abs(x) <= MAX_ABS and abs(y) <= MAX_ABS:
            xs.append(x)
            ys.append(y)
    return xs, ys


def label(text: str) -> str:
    """A name from a folder or a CSV header as plain text on a figure: never matplotlib's mathtext (a
    ``$`` pair is parsed as TeX: a forged name crashes or recurses the parser), no control characters,
    no bytes that are not text, at most 60 characters."""
    text = visible(text.encode("utf-8", errors="replace").decode("utf-8"))[:60]
    return text.replace("$", r"\$")


def _metric_of(rows: list[dict[str, str]], preferred: Optional[str]) -> Optional[str]:
    if preferred:
        return preferred if rows and preferred in rows[0] else None
    keys = [k for k in (rows[0] if rows else {}) if k.startswith("valid_") and k != "valid_loss"]
    return keys[0] if keys else None


def plot_runs(runs: Sequence[Path], out: Path, metric: Optional[str] = None) -> Path:
    """Left: training loss (steps, thin) and validation loss (epochs, marked) against step. Right: the
    monitored metric (``metric``, else the first valid_* column that is not the loss). One colour per run."""
    if metric is not None:
        columns = {
            k for folder in runs for row in read_csv(folder / CSV_FILES["epoch"])[:1] for k in row
        }
        if metric not in columns:
            shown_columns = ", ".join(
                sorted(visible(c) for c in columns if c not in ("step", "epoch"))
            )
            raise ConfigError(
                f"--metric {shown(metric)} is not a column of the runs' metrics.csv.",
                f"choose from {shown_columns[:300]}.",
            )
    # (checked before importing matplotlib, which writes its font cache on first import)
    return _drawn(_draw, runs, out, metric)


def _drawn(draw: Callable[..., Path], *args: Any) -> Path:
    """``draw(Figure, FigureCanvasAgg, *args)`` for every figure we make: matplotlib imported here (an
    optional extra), its own errors on values it cannot draw as one line, and its warning per glyph a
    font lacks (a run named in CJK or emoji) silenced - the figure shows a box, the terminal stays clean."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "plots need matplotlib.", "pip install matplotlib (or 'multigpu[plot]')."
        ) from None
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Glyph \d+ .*missing from font", category=UserWarning
        )
        try:
            return draw(Figure, FigureCanvasAgg, *args)
        # matplotlib's own
        except (ValueError, OverflowError, RecursionError, TypeError, RuntimeError) as exc:
            raise ConfigError(
                f"could not draw the figure: {type(exc).__name__}: {shown(str(exc), 120)}",
                "the files read hold values matplotlib cannot draw; check them.",
            ) from None


def _draw(
    Figure: Any, FigureCanvasAgg: Any, runs: Sequence[Path], out: Path, metric: Optional[str]
) -> Path:
    figure = Figure(figsize=SIZE_IN, dpi=DPI)
    FigureCanvasAgg(figure)
    loss_axes, metric_axes = figure.subplots(1, 2)
    chosen = None
    for index, folder in enumerate(runs):
        color = f"C{index % 10}"
        name = label(folder.name) if len(runs) > 1 else "train"
        steps, epochs = read_csv(folder / CSV_FILES["step"]), read_csv(folder / CSV_FILES["epoch"])
        xs, ys = _series(steps, "loss")
        if xs:
            loss_axes.plot(xs, ys, color=color, alpha=0.45, linewidth=0.8, label=f"{name} (steps)")
        xs, ys = _series(epochs, "train_loss")
        if xs:
            loss_axes.plot(
                xs,
                ys,
                color=color,
                linewidth=1.6,
                label=f"{name} train" if len(runs) > 1 else "train (epochs)",
            )
        xs, ys = _series(epochs, "valid_loss")
        if xs:
            loss_axes.plot(
                xs,
                ys,
                color=color,
                linestyle="--",
                marker="o",
                markersize=3,
                label=f"{name} valid" if len(runs) > 1 else "valid",
            )
        key = _metric_of(epochs, metric)
        if key is not None:
            chosen = chosen or key
            xs, ys = _series(epochs, key)
            metric_axes.plot(
                xs, ys, color=color, marker="o", markersize=3, label=label(folder.name)
            )
    loss_axes.set(title="loss", xlabel="optimizer step")
    metric_axes.set(
        title=label(chosen) if chosen else "no validation metric", xlabel="optimizer step"
    )
    for axes in (loss_axes, metric_axes):
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    figure.tight_layout()
    # matplotlib writes into a file the door opened (a fresh O_EXCL name renamed over the target): a
    # planted link in the output folder is replaced, never written through.
    with Folder(out.parent).create().open_new(out.name) as handle:
        figure.savefig(handle, dpi=DPI, format="png")
    return out


def write_curves(folder: Path, quiet: bool = False) -> Optional[Path]:
    """``folder/curves.png`` for one run; None (and no error) when matplotlib is missing or nothing was logged."""
    if not is_run(Path(folder)):
        return None
    try:
        return plot_runs([Path(folder)], Path(folder) / "curves.png")
    except ConfigError:
        if quiet:
            return None
        raise


def best_run(runs: Sequence[Path], metric: str, mode: str = "min") -> Optional[tuple[Path, float]]:
    """The run with the best last value of ``metric`` in metrics.csv (None if no run has it)."""
    scored = []
    for folder in runs:
        rows = read_csv(folder / CSV_FILES["epoch"])
        xs, ys = _series(rows, metric)
        if ys:
            scored.append((folder, ys[-1]))
    if not scored:
        return None
    return (min if mode == "min" else max)(scored, key=lambda item: item[1])


# ---------------------------------------------------------------------------------- sweeps

#: Where a queue keeps each sweep's record (``multigpu queue`` writes ``OUT/.sweeps/<family>.json``).
SWEEPS_FOLDER = ".sweeps"
MAX_RECORD_BYTES = 32 << 20
#: A trial's reports are a row per report: a few KB. A bigger file is cut (its first rows are read).
MAX_REPORTS_BYTES = 2 << 20
#: Trials a record may hold (a search's own limit) and distinct values one panel labels on its axis.
MAX_RECORD_TRIALS = 10_000
MAX_LABELS = 40
#: Swept overrides drawn, at most (one panel each).
MAX_PANELS = 8


def sweep_records(folder: Path) -> list[Path]:
    """The sweep records of a queue folder ([] when it ran no sweep)."""
    records = Folder(folder)
    if records.kind(SWEEPS_FOLDER) != "folder":
        return []
    return [
        folder / SWEEPS_FOLDER / name
        for name, kind in records.entries(SWEEPS_FOLDER)
        if kind == "file" and name.endswith(".json") and not name.startswith(".")
    ]


def read_record(path: Path) -> dict[str, Any]:
    """A sweep record, checked: anything malformed in it is a ConfigError naming the file, never a
    traceback (it is data from disk - a folder someone sent you)."""
    import json

    bad = ConfigError(
        f"{path} is not a sweep record written by `multigpu queue`.",
        "run the queue again to rewrite it.",
    )
    try:
        data = json.loads(Folder(path.parent).load_text(path.name, limit=MAX_RECORD_BYTES))
    except (OSError, ValueError, RecursionError):
        raise bad from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("params"), dict)
        or not isinstance(data.get("trials"), list)
    ):
        raise bad
    if data.get("mode") not in ("min", "max") or not isinstance(data.get("metric"), str):
        raise bad
    trials = []
    for trial in data["trials"][:MAX_RECORD_TRIALS]:
        if (
            isinstance(trial, dict)
            and isinstance(trial.get("run"), str)
            and isinstance(trial.get("values"), dict)
            and isinstance(trial.get("reports"), str)
            and trial.get("state")
            in ("done", "pruned", "failed", "interrupted", "queued", "running")
        ):
            trial["value"] = _plottable(trial.get("value"))
            trials.append(trial)
    data["trials"] = trials
    return data


def _plottable(value: Any) -> Optional[float]:
    """A number an axis can hold, or None (a string, a bool, nan, 1e308, an integer of 400 digits)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and abs(number) <= MAX_ABS else None


def _reports(queue: Path, relative: str) -> tuple[list[float], list[float]]:
    """(steps, values) a trial reported: ``relative`` is read below the queue folder, one component at a
    time (a link or a ``..`` in it reads nothing)."""
    import csv
    import io

    try:
        text = (
            Folder(queue)
            .load_bytes(relative, MAX_REPORTS_BYTES)[:MAX_REPORTS_BYTES]
            .decode("utf-8", "replace")
        )
    except OSError:
        return [], []
    xs, ys = [], []
    for row in csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1])):
        try:
            x, y = float(row.get("step") or "nan"), float(row.get("value") or "nan")
        except (TypeError, ValueError):
            continue
        if math.isfinite(x) and math.isfinite(y) and abs(x) <= MAX_ABS and abs(y) <= MAX_ABS:
            xs.append(x)
            ys.append(y)
    return xs, ys


def plot_sweep(record: Path, out: Path, top: int = 5) -> Path:
    """One figure for one sweep: the metric's curves of the ``top`` best trials (by the record's ranking),
    and the metric against each swept override - finished trials as dots, pruned ones as crosses (their
    last value), on a log axis for a loguniform range."""
    data = read_record(record)
    return _drawn(_draw_sweep, data, record.parent.parent, out, top)


def _draw_sweep(
    Figure: Any, FigureCanvasAgg: Any, data: dict[str, Any], queue: Path, out: Path, top: int
) -> Path:
    params = list(data["params"].items())[:MAX_PANELS]
    panels = 1 + len(params)
    columns = min(panels, 3)
    rows = -(-panels // columns)
    figure = Figure(figsize=(4.2 * columns, 3.4 * rows), dpi=DPI)
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    metric, trials = data["metric"], data["trials"]
    best = [t for t in trials if t["value"] is not None][:top]
    # trials may name one reports file: read once
    read: dict[str, tuple[list[float], list[float]]] = {}
    for index, trial in enumerate(best):
        if trial["reports"] not in read:
            read[trial["reports"]] = _reports(queue, trial["reports"])
        xs, ys = read[trial["reports"]]
        if xs:
            style = "--" if trial["state"] == "pruned" else "-"
            axes[0].plot(
                xs,
                ys,
                style,
                color=f"C{index % 10}",
                marker="o",
                markersize=2.5,
                label=label(f"{trial['run'][:40]} ({trial['value']:.4g})"),
            )
    axes[0].set(
        title=label(f"{metric}: best {len(best)} of {len(trials)} ({data['mode']})"),
        xlabel="optimizer step",
    )
    for panel, (key, space) in zip(axes[1:], params):
        _value_panel(panel, str(key), space if isinstance(space, dict) else {}, trials, metric)
    for panel in axes[panels:]:
        panel.set_visible(False)
    for panel in axes[:panels]:
        panel.grid(alpha=0.3)
        if panel.get_legend_handles_labels()[0]:
            panel.legend(fontsize=6)
    figure.tight_layout()
    with Folder(out.parent).create().open_new(out.name) as handle:
        figure.savefig(handle, dpi=DPI, format="png")
    return out


def _value_panel(
    panel: Axes, key: str, space: dict[str, Any], trials: list[dict[str, Any]], metric: str
) -> None:
    """``metric`` against one swept override: a list of values (grid, choice) or text on evenly spaced
    ticks in their order; a range on its own axis (log for loguniform)."""
    values = [t["values"].get(key) for t in trials]
    numeric = all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values if v is not None
    )
    if numeric:  # a value beyond what an axis can hold (1e308) is left out, as in the run curves
        values = [_plottable(v) for v in values]
    labels: list[str] = []
    if space.get("kind") in ("grid", "choice") or not numeric:
        present = {str(v)[:200]: v for v in values}
        order = sorted(
            present,
            key=lambda k: (
                (0, float(present[k]), k) if numeric and present[k] is not None else (1, 0.0, k)
            ),
        )
        # the rest are not placed: a panel of 8,000 labels says nothing
        labels = list(order)[:MAX_LABELS]
    position = {text: index for index, text in enumerate(labels)}
    for state, marker, color in (("done", "o", "C0"), ("pruned", "x", "0.5")):
        xs, ys = [], []
        for trial, value in zip(trials, values):
            if trial["state"] == state and trial["value"] is not None and value is not None:
                if labels and str(value)[:200] not in position:
                    continue
                xs.append(position[str(value)[:200]] if labels else float(value))
                ys.append(trial["value"])
        if xs:
            panel.scatter(xs, ys, marker=marker, color=color, s=18, label=state)
    if space.get("kind") == "loguniform" and not labels:
        panel.set_xscale("log")
    if labels:
        panel.set_xticks(
            range(len(labels)), [label(text[:12]) for text in labels], rotation=30, fontsize=7
        )
    panel.set(title=label(f"{metric} against {key}"), xlabel=label(key[:40]))
