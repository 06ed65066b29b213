"""Where the Trainer's numbers go: CSV files (always), TensorBoard, Weights & Biases, MLflow.

Why a three-method protocol (``log_metrics``, ``log_hparams``, ``close``): the loop calls it once per
logged step and never cares where the numbers end up (torchtitan's BaseLogger and Fabric's loggers
work the same way). Only rank 0 logs. Rows come in two kinds: ``step`` rows every
``log_every_n_steps`` (loss, learning rate, samples/s, gradient norm, GPU memory) and ``epoch`` rows
(epoch averages, validation metrics - also from ``eval_every_steps``). A resumed run continues the
same curves: rows after the resumed step are dropped (CSV), purged (TensorBoard) or skipped
(Weights & Biases, MLflow: they keep what they have and get only later steps). The backends other
than CSV are optional: TensorBoard comes with ``torch.utils.tensorboard`` when the ``tensorboard``
package is installed; ``wandb`` and ``mlflow`` are extras. None of them is required to train.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from multigpu.errors import ConfigError, shown, visible
from multigpu.fileio import Folder, UnsafePath

KINDS = ("step", "epoch")
#: metrics.csv holds the epoch rows (one per epoch, and per eval_every_steps validation); steps.csv the step rows.
CSV_FILES = {"epoch": "metrics.csv", "step": "steps.csv"}


class Logger(Protocol):
    def log_metrics(self, row: Mapping[str, Any], step: int, kind: str = "epoch") -> None: ...

    def log_hparams(self, config: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _numbers(row: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in row.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(float(value)):
            out[str(key)] = float(value)
    return out


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"hidden": 64}}`` -> ``{"model.hidden": 64}`` (lists and other values as text)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[name] = value
        else:
            out[name] = str(value)
    return out


# ------------------------------------------------------------------------------------------- CSV


#: The CSV files' wall-clock column: Unix seconds when the row was written (a row's own value wins).
WALL_TIME = "wall_time"


class CSVLogger:
    """``metrics.csv`` (epoch rows) and ``steps.csv`` (step rows), appended one row at a time, each with
    its :data:`WALL_TIME` (grep a log by time, plot against hours, line two runs up).

    A row is one ``write`` of a complete line, flushed: a crash leaves whole rows (a torn last line is
    dropped on the next start). A row with a new column rewrites the file once with the wider header
    (atomically). On resume, rows after the resumed step are removed, so the curve continues without
    duplicates.
    """

    def __init__(self, folder: Path, resume_step: Optional[int] = None) -> None:
        self.folder = Path(folder)
        self.root = Folder(folder).create()
        self._columns: dict[str, list[str]] = {}
        for kind, name in CSV_FILES.items():
            rows = read_csv(self.folder / name)
            kept = [r for r in rows if resume_step is None or _step_of(r) <= resume_step]
            if rows and (len(kept) != len(rows) or not _ends_with_newline(self.root, name)):
                self._rewrite(name, kept, _columns_of(kept))
            self._columns[kind] = _columns_of(kept)

    def log_metrics(self, row: Mapping[str, Any], step: int, kind: str = "epoch") -> None:
        name = CSV_FILES[kind]
        row = {
            "step": step,
            WALL_TIME: round(time.time(), 3),
            **{k: v for k, v in row.items() if k != "step"},
        }
        columns = self._columns[kind]
        if not columns or any(k not in columns for k in row):
            rows = read_csv(self.folder / name)
            self._columns[kind] = columns = [*columns, *(k for k in row if k not in columns)]
            self._rewrite(name, [*rows, row], columns)
            return
        buffer = io.StringIO()
        csv.DictWriter(buffer, fieldnames=columns).writerow(row)
        with self.root.open_append(name) as handle:
            handle.write(buffer.getvalue())
            handle.flush()

    def log_hparams(self, config: Mapping[str, Any]) -> None:
        pass  # config.yaml next to the outputs is the recipe's record of it

    def close(self) -> None:
        pass

    def _rewrite(self, name: str, rows: Sequence[Mapping[str, Any]], columns: list[str]) -> None:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
        self.root.write_atomic(name, buffer.getvalue())


#: A metrics file larger than this is refused (a curve of a million logged steps is ~100 MB).
MAX_CSV_BYTES = 256 << 20


def read_csv(path: Path) -> list[dict[str, str]]:
    """The complete rows of a metrics CSV ([] if missing); a torn last line is left out. A link, FIFO,
    device or a file over MAX_CSV_BYTES is refused (UnsafePath, an OSError)."""
    path = Path(path)
    try:
        text = Folder(path.parent).load_text(path.name, limit=MAX_CSV_BYTES)
    except FileNotFoundError:
        return []
    except UnsafePath as exc:
        raise ConfigError(
            f"{visible(str(path))} {exc.strerror}.",
            "a metrics file must be a regular file "
            f"of at most {MAX_CSV_BYTES >> 20} MiB; move it away (or use another out_dir).",
        ) from None
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    try:
        return [dict(r) for r in csv.DictReader(io.StringIO(text)) if None not in r]
    except csv.Error:
        return []


def _columns_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    return columns


def _step_of(row: Mapping[str, Any]) -> float:
    try:
        return float(row.get("step") or 0)
    except ValueError:
        return 0.0


def _ends_with_newline(root: Folder, name: str) -> bool:
    try:
        with root.open_read(name) as handle:
            handle.seek(-1, os.SEEK_END)
            return handle.read(1) == b"\n"
    except OSError:
        return True


# ----------------------------------------------------------------------------------- TensorBoard


class TensorBoardLogger:
    """``torch.utils.tensorboard`` event files in ``OUT/tensorboard``; tags ``step/loss``, ``epoch/valid_loss``."""

    def __init__(self, folder: Path, resume_step: Optional[int] = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "loggers: tensorboard needs the tensorboard package.",
                "pip install tensorboard (or drop tensorboard from loggers).",
            ) from None
        # purge_step: events after the resumed step, written before a crash, are discarded by TensorBoard.
        # A store the door checked whole: a planted link anywhere in it is refused, never written through.
        self.writer = SummaryWriter(
            log_dir=str(store_folder(folder, "tensorboard").path),
            purge_step=resume_step + 1 if resume_step is not None else None,
        )

    def log_metrics(self, row: Mapping[str, Any], step: int, kind: str = "epoch") -> None:
        for key, value in _numbers(row).items():
            if key != "step":
                self.writer.add_scalar(f"{kind}/{key}", value, global_step=step)
        self.writer.flush()

    def log_hparams(self, config: Mapping[str, Any]) -> None:
        text = "\n".join(f"    {k}: {v}" for k, v in flatten(config).items())
        self.writer.add_text("hparams", text)

    def close(self) -> None:
        self.writer.close()


# ------------------------------------------------------------------------------ Weights & Biases


class WandbLogger:
    """A W&B run named after the output folder (offline with ``WANDB_MODE=offline``: files only)."""

    def __init__(self, folder: Path, resume_step: Optional[int] = None) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "loggers: wandb needs the wandb package.",
                "pip install 'multigpu[wandb]' (or drop wandb from loggers).",
            ) from None
        folder = Path(folder).resolve()
        root = Folder(folder).create()
        # checked whole: W&B's own links stay inside it
        store_folder(folder, "wandb", inner_links=True)
        # The id lives in the run folder: a resume continues the same W&B run, while a new folder (or a
        # deleted and recreated one, or the same path on another machine) starts a new one.
        run_id = _run_id(root, ".wandb_run_id")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id):
            run_id = re.sub(r"[^A-Za-z0-9_-]", "-", f"{folder.name[:40]}-{secrets.token_hex(4)}")
            root.write_atomic(".wandb_run_id", run_id)
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "multigpu"),
                name=folder.name,
                id=run_id,
                dir=str(folder),
                resume="allow",
                reinit=True,
            )
        # no API key, no network, a refused project: W&B's own exception types
        except Exception as exc:
            raise ConfigError(
                f"loggers: wandb could not start: {' '.join(str(exc).split())[:300]}",
                "run `wandb login`, or set WANDB_MODE=offline (sync later with `wandb sync`), "
                "or drop wandb from loggers.",
            ) from None
        self.start = max(resume_step or 0, int(getattr(self.run, "step", 0) or 0))

    def log_metrics(self, row: Mapping[str, Any], step: int, kind: str = "epoch") -> None:
        if step < self.start:
            return  # already logged before the resume: W&B keeps steps increasing
        self.run.log({f"{kind}/{k}": v for k, v in _numbers(row).items() if k != "step"}, step=step)

    def log_hparams(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(flatten(config), allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


# ---------------------------------------------------------------------------------------- MLflow


#: A tracking URI: a scheme and its ``:`` (``http://``, ``file:///``, ``sqlite:///``, ``databricks://``), or
#: MLflow's bare ``databricks`` (the default profile).
_MLFLOW_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:\S+|databricks")


class MLflowLogger:
    """An MLflow run named after the output folder, in ``MLFLOW_TRACKING_URI`` (default: a file store in
    ``OUT/mlruns``). A resumed run logs into the same MLflow run, only steps it has not logged yet."""

    def __init__(self, folder: Path, resume_step: Optional[int] = None) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(
                "loggers: mlflow needs the mlflow package.",
                "pip install 'multigpu[mlflow]' (or drop mlflow from loggers).",
            ) from None
        folder = Path(folder).resolve()
        root = Folder(folder).create()
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri and not _MLFLOW_URI.fullmatch(uri):
            # MLflow reads a bare path as a file store relative to the working folder (where
            # MLFLOW_ALLOW_FILE_STORE is set): a typo would write runs anywhere.
            raise ConfigError(
                f"loggers: MLFLOW_TRACKING_URI {shown(uri)} is not a URI (scheme://...).",
                "name a server (http://host:5000), a database (sqlite:///abs/path.db) or a file store "
                "(file:///abs/path), or unset it for a file store in the run folder.",
            )
        if not uri:
            # No server named: a file store beside the run, readable with `mlflow ui --backend-store-uri`.
            # MLflow 3 keeps that backend in maintenance mode and refuses it unless this variable opts in;
            # a tracking URI of the user's own (a server, sqlite:///...) is used as given.
            uri = store_folder(folder, "mlruns").path.as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "multigpu")
        try:
            self.client = MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(experiment)
            )
        # an unreachable server, a refused store: MLflow's own exception types
        except Exception as exc:
            raise ConfigError(
                f"loggers: mlflow could not reach {shown(uri)}: {shown(' '.join(str(exc).split()), 300)}",
                "check MLFLOW_TRACKING_URI (unset: a file store in the run folder), or drop mlflow "
                "from loggers.",
            ) from None
        run_id = _run_id(root, ".mlflow_run_id")
        if run_id and not re.fullmatch(r"[0-9a-f]{32}", run_id):
            run_id = ""  # not an id MLflow made: a new run
        if run_id:
            # the run this folder started, in this experiment: a planted id of another run is not followed
            try:
                found_run = self.client.get_run(run_id)
                if (
                    found_run.info.experiment_id != experiment_id
                    or found_run.info.lifecycle_stage != "active"
                    or found_run.data.tags.get("multigpu.out_dir") != str(folder)
                ):
                    run_id = ""  # another folder's run, or one the user deleted: a new one
            except Exception:
                run_id = ""
        if not run_id:
            run_id = self.client.create_run(
                experiment_id, run_name=folder.name, tags={"multigpu.out_dir": str(folder)}
            ).info.run_id
            root.write_atomic(".mlflow_run_id", run_id)
        self.run_id = run_id
        self._logged: dict[str, int] = {}

    def _last_step(self, key: str) -> int:
        if key not in self._logged:
            history = self.client.get_metric_history(self.run_id, key)
            self._logged[key] = max((m.step for m in history), default=-1)
        return self._logged[key]

    def log_metrics(self, row: Mapping[str, Any], step: int, kind: str = "epoch") -> None:
        import time as _time

        from mlflow.entities import Metric

        now = int(_time.time() * 1000)
        metrics = []
        for key, value in _numbers(row).items():
            name = f"{kind}/{key}"
            if key == "step" or step <= self._last_step(name):
                continue
            metrics.append(Metric(name, value, now, step))
            self._logged[name] = step
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_hparams(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k[:250], str(v)[:500]) for k, v in flatten(config).items()]
        existing = self.client.get_run(self.run_id).data.params
        params = [p for p in params if p.key not in existing]
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


BACKENDS: dict[str, Callable[[Path, Optional[int]], Logger]] = {
    "csv": CSVLogger,
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
    "mlflow": MLflowLogger,
}


class Loggers:
    """The chosen loggers as one (rank 0); an empty one elsewhere."""

    def __init__(
        self,
        names: Sequence[str],
        folder: Path,
        resume_step: Optional[int] = None,
        enabled: bool = True,
    ) -> None:
        unknown = [n for n in names if n not in BACKENDS]
        if unknown:
            raise ConfigError(
                f"unknown logger {unknown[0]!r}.", f"choose from {', '.join(BACKENDS)}."
            )
        self.loggers: list[Logger] = []
        if enabled:
            # CSV always: the queue and `multigpu plot` read it
            for name in dict.fromkeys(["csv", *names]):
                self.loggers.append(BACKENDS[name](folder, resume_step))

    def log_metrics(self, row: Mapping[str, Any], step: int, kind: str = "epoch") -> None:
        for logger in self.loggers:
            logger.log_metrics(row, step, kind)

    def log_hparams(self, config: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_hparams(config)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []


def hparams_of(settings: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """What a run logs as hyperparameters: the recipe's resolved config and the Trainer settings."""
    plain: dict[str, Any] = json.loads(
        json.dumps({"config": config, "trainer": settings}, default=str)
    )
    return plain


#: The folders of the run folder that other libraries write into, by logger: each opened through
#: :func:`store_folder` (tests/test_borders.py checks that every logger but CSV does).
STORES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlruns"}


def store_folder(folder: Path, name: str, inner_links: bool = False) -> Folder:
    """``folder/name`` for a library to write into, checked whole first (:meth:`Folder.store`): a planted
    link, FIFO or device anywhere in it, or another user's file, is one line before the library opens it.
    ``inner_links``: the library makes links inside its store itself (W&B)."""
    try:
        return Folder(folder).store(name, inner_links=inner_links)
    except UnsafePath as exc:
        raise ConfigError(
            f"{visible(str(exc.filename))} {exc.strerror}; another library writes into the store "
            f"{name}/ as it finds it.",
            f"move {visible(str(Path(folder) / name))} aside and let the run make a new one.",
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"cannot use {visible(str(Path(folder) / name))}: {exc.strerror or exc}.",
            "give the run a folder it can write to.",
        ) from None


def _run_id(root: Folder, name: str) -> str:
    """A logger's run id kept in the run folder ('' when there is none yet); a planted link, FIFO or
    device in its place is one line, not a traceback or a hang."""
    try:
        return root.load_bytes(name, 200)[:200].decode(errors="replace").strip()
    except FileNotFoundError:
        return ""
    except UnsafePath as exc:
        raise ConfigError(
            f"{visible(str(root / name))} is not a regular file ({exc.strerror}).",
            "remove it; it holds only the logger's run id.",
        ) from None
