"""Loss curves as PNG, from the CSV files a run writes: ``multigpu plot OUT...`` and ``curves.png``.

Why from the files: a run folder - or a queue folder full of them - is all there is after training,
on a laptop or a cluster's login node, with no TensorBoard server. Several runs are overlaid in one
figure, labelled by folder name. matplotlib is optional (the ``plot`` extra): without it the Trainer
skips ``curves.png`` and the command says how to install it. Drawn with matplotlib's object API on
its Agg canvas, so no global pyplot state and no display is needed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

from multigpu.errors import ConfigError, shown, visible
from multigpu.fileio import Folder
from multigpu.loggers import CSV_FILES, read_csv

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
            raise ConfigError(f"{path} is not a folder.", "give a run's out_dir or a queue's --out folder.")
        if is_run(path):
            runs.append(path)
            continue
        inside = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".") and is_run(p))
        if not inside:
            raise ConfigError(f"{path} holds no metrics.csv or steps.csv (nor do its subfolders).",
                              "give the folder a run wrote into (its trainer.out_dir).")
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
        columns = {k for folder in runs for row in read_csv(folder / CSV_FILES["epoch"])[:1] for k in row}
        if metric not in columns:
            shown_columns = ", ".join(sorted(visible(c) for c in columns if c not in ("step", "epoch")))
            raise ConfigError(f"--metric {shown(metric)} is not a column of the runs' metrics.csv.",
                              f"choose from {shown_columns[:300]}.")
    # (checked before importing matplotlib, which writes its font cache on first import)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plots need matplotlib.", "pip install matplotlib (or 'multigpu[plot]').") from None
    try:
        return _draw(Figure, FigureCanvasAgg, runs, out, metric)
    except (ValueError, OverflowError, RecursionError, TypeError, RuntimeError) as exc:  # matplotlib's own errors
        raise ConfigError(f"could not draw the curves: {type(exc).__name__}: {shown(str(exc), 120)}",
                          "the runs' metrics files hold values matplotlib cannot draw; check them.") from None


def _draw(Figure: Any, FigureCanvasAgg: Any, runs: Sequence[Path], out: Path, metric: Optional[str]) -> Path:
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
            loss_axes.plot(xs, ys, color=color, linewidth=1.6, label=f"{name} train" if len(runs) > 1 else "train (epochs)")
        xs, ys = _series(epochs, "valid_loss")
        if xs:
            loss_axes.plot(xs, ys, color=color, linestyle="--", marker="o", markersize=3,
                           label=f"{name} valid" if len(runs) > 1 else "valid")
        key = _metric_of(epochs, metric)
        if key is not None:
            chosen = chosen or key
            xs, ys = _series(epochs, key)
            metric_axes.plot(xs, ys, color=color, marker="o", markersize=3, label=label(folder.name))
    loss_axes.set(title="loss", xlabel="optimizer step")
    metric_axes.set(title=label(chosen) if chosen else "no validation metric", xlabel="optimizer step")
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
