"""Seeing what training does: loggers read back (CSV, TensorBoard, MLflow, W&B offline), resumed curves
without duplicates, hooks in order, the best checkpoint and early stopping (2 processes against 1),
plots, the progress line in a log file, `run --debug` and `env`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import SCRIPTS, multigpu, multigpu_here
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.loggers import read_csv

# A test here launches at most two short runs (up to ~1 min each on 2 busy cores).
pytestmark = pytest.mark.timeout(300)


class Fit(mg.Trainer):
    def compute_loss(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)


def _data(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def _train(out: Path, epochs: int, **settings) -> Fit:
    with mg.init(env={}) as run:
        torch.manual_seed(0)
        trainer = Fit(
            run,
            nn.Linear(4, 3),
            lambda p: torch.optim.SGD(p, lr=0.1),
            batch_size=4,
            epochs=epochs,
            out_dir=str(out),
            progress=False,
            **settings,
        )
        trainer.fit(_data(), _data(12, 1))
        return trainer


# ------------------------------------------------------------------ loggers


def test_csv_rows_append_and_a_resume_continues_without_duplicates(tmp_path):
    _train(tmp_path, 2, log_every_n_steps=3)
    steps = read_csv(tmp_path / "steps.csv")
    assert [int(r["step"]) for r in steps] == [3, 6, 9, 12, 15]
    assert {"loss", "lr", "samples_per_s", "epoch", "wall_time"} <= set(steps[0])
    # when each row was written: in order, and today's
    written = [float(r["wall_time"]) for r in steps]
    assert written == sorted(written) and abs(written[-1] - __import__("time").time()) < 3600
    # rows written after the last checkpoint, then a crash: the resume drops them, the curve continues
    with open(tmp_path / "steps.csv", "a") as handle:
        handle.write("18,1.9,9.9,0.1,1\n21,1.8,9.9,0.1,1\n99,torn li")
    _train(tmp_path, 4, log_every_n_steps=3)
    steps = [int(r["step"]) for r in read_csv(tmp_path / "steps.csv")]
    assert steps == sorted(set(steps)) and steps[-1] == 30 and 99 not in steps
    epochs = read_csv(tmp_path / "metrics.csv")
    assert [float(r["epoch"]) for r in epochs] == [1.0, 2.0, 3.0, 4.0]
    assert {"valid_loss", "train_loss", "wall_time"} <= set(epochs[0])


def test_tensorboard_events_read_back_and_resumed_steps_are_not_doubled(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _train(tmp_path, 2, log_every_n_steps=2, loggers=["tensorboard"])
    _train(tmp_path, 3, log_every_n_steps=2, loggers=["tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = [e.step for e in events.Scalars("step/loss")]
    assert losses == sorted(set(losses)) and losses[-1] == 24
    assert [e.step for e in events.Scalars("epoch/valid_loss")] == [8, 16, 24]
    assert "hparams" in "".join(events.Tags()["tensors"])


def test_mlflow_file_store_reads_back(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    _train(tmp_path, 2, log_every_n_steps=4, loggers=["mlflow"])
    _train(tmp_path, 3, log_every_n_steps=4, loggers=["mlflow"])  # the same MLflow run continues
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "multigpu"]
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == tmp_path.name
    history = client.get_metric_history(found.info.run_id, "step/loss")
    assert sorted(m.step for m in history) == [4, 8, 12, 16, 20, 24]
    assert [m.step for m in client.get_metric_history(found.info.run_id, "epoch/valid_loss")] == [
        8,
        16,
        24,
    ]
    assert found.data.params["trainer.epochs"] == "2"


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B offline transaction log (``run-*.wandb``), read by hand: wandb >= 0.19 ships
    no Python reader. The format is LevelDB's log: a 7-byte header (":W&B", magic, version), then
    32 KiB blocks of records, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last); a block's tail shorter than a header is padding."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:
            offset += block - offset % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        if kind == 0 and length == 0:
            break
        payload = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            records.append(pending + payload)
    return records


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _train(tmp_path, 2, log_every_n_steps=4, loggers=["wandb"])
    (log,) = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    logged, config = {}, {}
    for data in _wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): item.value_json
                for item in record.history.item
            }
            logged[int(items["_step"])] = items
        elif record.WhichOneof("record_type") == "config":
            config.update(
                {
                    item.key or "/".join(item.nested_key): item.value_json
                    for item in record.config.update
                }
            )
    assert (
        {4, 8, 12, 16} <= set(logged)
        and "step/loss" in logged[4]
        and "epoch/valid_loss" in logged[16]
    )
    assert any("epochs" in value for value in config.values()) or any(
        "epochs" in key for key in config
    )


# ------------------------------------------------------------------ hooks, best, early stopping


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> dict:
    """observe.py on 1 process (batch 16) and on 2 (batch 8): one launch each, shared by the hook test and the
    best-checkpoint test."""
    root = tmp_path_factory.mktemp("observe")
    results = {}
    for nproc, batch in ((1, "16"), (2, "8")):
        out = root / f"p{nproc}"
        proc = multigpu(
            "run",
            "--nproc",
            str(nproc),
            str(SCRIPTS / "observe.py"),
            str(out),
            "--batch",
            batch,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr
        results[nproc] = {
            "out": out,
            "stdout": proc.stdout,
            **json.loads((out / "result.json").read_text()),
        }
    return results


def test_hooks_are_called_in_the_documented_order_with_epochs_from_one(observed):
    calls = observed[1]["calls"]
    assert calls[:2] == ["fit_start", "epoch_start 1"]
    first_epoch = calls[calls.index("epoch_start 1") : calls.index("epoch_start 2")]
    assert (
        first_epoch.index("evaluate_start")
        < first_epoch.index("validation_end")
        < first_epoch.index("epoch_end 1")
    )
    assert first_epoch[-1] == "checkpoint checkpoints" and "checkpoint best" in first_epoch
    assert calls[-1] == "fit_end"  # after an early stop too


def test_best_checkpoint_and_early_stopping_agree_on_two_processes_and_one(observed):
    for nproc in (1, 2):
        out = observed[nproc]["out"]
        assert "early stop: valid_loss did not improve" in observed[nproc]["stdout"]
        (best,) = (out / "checkpoints" / "best").glob("step-*")
        manifest = json.loads((best / "manifest.json").read_text())
        assert (
            manifest["monitor"] == "valid_loss" and manifest["step"] == observed[nproc]["best_step"]
        )
        listing = multigpu_here("checkpoint", "verify", str(best), check=True)
        assert "ok" in listing.stdout
    one, two = observed[1], observed[2]
    assert one["best_step"] == two["best_step"] and one["stopped_at"] == two["stopped_at"] < 80
    assert abs(one["best"] - two["best"]) < 1e-5


def test_a_resumed_run_keeps_the_best_so_far_and_the_patience_count(tmp_path):
    first = _train(tmp_path, 2, monitor="valid_loss", patience=50)
    best, step = first.tracker.best, first.tracker.best_step
    with mg.init(env={}) as run:
        trainer = Fit(
            run,
            nn.Linear(4, 3),
            lambda p: torch.optim.SGD(p, lr=0.1),
            batch_size=4,
            epochs=3,
            out_dir=str(tmp_path),
            progress=False,
            monitor="valid_loss",
            patience=50,
        )
        assert trainer.resume()
        assert (trainer.tracker.best, trainer.tracker.best_step) == (best, step)
        assert trainer.tracker.bad_evaluations == first.tracker.bad_evaluations


# ------------------------------------------------------------------ plots and progress


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_plot_writes_a_png_for_a_run_and_for_a_queue_folder(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("a", "b"):
        _train(tmp_path / "queue" / name, 2, log_every_n_steps=2)
    # written by fit itself
    assert _png_size(tmp_path / "queue" / "a" / "curves.png") == (1100, 400)
    proc = multigpu_here(
        "plot", str(tmp_path / "queue" / "a"), "--out", str(tmp_path / "one.png"), check=True
    )
    assert _png_size(tmp_path / "one.png") == (1100, 400) and "one.png" in proc.stdout
    proc = multigpu_here(
        "plot", str(tmp_path / "queue"), "--out", str(tmp_path / "both.png"), check=True
    )
    assert _png_size(tmp_path / "both.png") == (1100, 400) and "2 run(s)" in proc.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = multigpu_here("plot", str(empty))
    assert refused.returncode == 2 and "holds no metrics.csv" in refused.stderr


SLOW_TRAINER = """\
import json, os, sys, time, torch, multigpu as mg
from torch import nn
from torch.utils.data import TensorDataset
class T(mg.Trainer):
    def compute_loss(self, b):
        time.sleep(0.05)
        return nn.functional.mse_loss(self.model(b[0]), b[1])
run = mg.init()
T(run, nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1), batch_size=2, epochs=2, progress_every_s=0.3,
  out_dir=sys.argv[1], plot=False).fit(TensorDataset(torch.randn(40, 2), torch.randn(40, 1)))
def pipes_held_by_children(fd):  # the stream copiers are this worker's children
    kids = [p for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1]
            == str(os.getpid())]
    return sum(os.readlink(f'/proc/{k}/fd/2') == os.readlink(f'/proc/self/fd/{fd}') for k in kids)
if run.is_main:  # one line: two ranks' prints share one stdout and may interleave
    shown = {k: os.environ.get(k) for k in ('TORCH_DISTRIBUTED_DEBUG', 'NCCL_DEBUG', 'TORCH_FR_BUFFER_SIZE',
                                            'TORCH_NCCL_TRACE_BUFFER_SIZE')}
    print(json.dumps({**shown, 'copiers_holding_stderr_pipe': pipes_held_by_children(2)}))
"""


@pytest.fixture(scope="module")
def debug_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("debug")


@pytest.fixture(scope="module")
def debug_run(debug_folder):
    """One 2-process launch of a Trainer with --debug and --log-dir, its output a pipe (a log file, not a
    terminal): read by the progress test, the debug test and the log folder's test."""
    folder = debug_folder
    script = folder / "slow.py"
    script.write_text(SLOW_TRAINER)
    return multigpu(
        "run",
        "--debug",
        "--nproc",
        "2",
        "--log-dir",
        str(folder / "logs"),
        str(script),
        str(folder / "out"),
        check=True,
    )


def test_a_named_log_dir_keeps_each_ranks_stdout_beside_its_stderr(debug_run, debug_folder):
    """torchrun's --log-dir with --tee 3 keeps both streams; ours kept stderr only (issue 52, item 8)."""
    logs = debug_folder / "logs"
    kept = (logs / "rank0.attempt0.stdout").read_text()
    assert '"TORCH_DISTRIBUTED_DEBUG": "INFO"' in kept  # the script's own print, rank 0's
    # the terminal still gets every line
    assert "epoch 2/2" in kept and "epoch 2/2" in debug_run.stdout
    assert (logs / "rank1.attempt0.stdout").is_file() and (logs / "rank1.attempt0.stderr").is_file()


def test_the_progress_line_prints_in_a_log_file_and_the_start_report(debug_run):
    lines = [
        line
        for line in debug_run.stdout.splitlines()
        if line.startswith("epoch ") and "ETA" in line
    ]
    assert len(lines) >= 2, debug_run.stdout
    assert "samples/s elapsed 0:0" in lines[0] and "/10]" not in lines[0]
    assert (
        "3 parameters (3 trainable); strategy ddp, precision 32; 10 optimizer steps per epoch"
        in debug_run.stdout
    )


# ------------------------------------------------------------------ run --debug, env


@pytest.mark.timeout(120)  # one 2-process launch of a few DDP steps (~10 s here)
def test_run_debug_with_ddp_on_cpu_processes_works_and_says_what_it_turned_on(debug_run):
    """torch 2.13's DETAIL mode with DDP over gloo ends in SIGSEGV: on CPU processes --debug turns on INFO."""
    shown = json.loads(debug_run.stdout.strip().splitlines()[-1])
    # Fresh-eyes finding F7: the stdout copier held the stderr pipe open (the stderr copier then waited
    # for it at exit, and was killed when a child of the script kept stdout open).
    assert shown.pop("copiers_holding_stderr_pipe") == 0
    assert shown == {
        "TORCH_DISTRIBUTED_DEBUG": "INFO",
        "NCCL_DEBUG": None,
        "TORCH_FR_BUFFER_SIZE": None,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": None,
    }
    assert "debug: TORCH_DISTRIBUTED_DEBUG=INFO" in debug_run.stderr


def test_debug_on_gpus_turns_on_detail_nccl_and_the_flight_recorder_by_its_current_name(
    tmp_path, monkeypatch
):
    from multigpu.launch.local import debug_env

    for name in (
        "TORCH_DISTRIBUTED_DEBUG",
        "NCCL_DEBUG",
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    new, old = (
        debug_env(str(tmp_path), True, "2.13.0+cu130"),
        debug_env(str(tmp_path), True, "2.6.0"),
    )
    assert new["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and new["NCCL_DEBUG"] == "INFO"
    # deprecated name
    assert new["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in new
    assert old["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and "TORCH_FR_BUFFER_SIZE" not in old
    assert new["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(str(tmp_path))
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    # the user's own value wins
    assert debug_env(str(tmp_path), True, "2.13.0")["NCCL_DEBUG"] == "WARN"


def test_env_reports_variables_and_the_check_measures_an_all_reduce(tmp_path):
    proc = multigpu("env", env={"NCCL_SOCKET_IFNAME": "lo", "TORCH_LOGS": "+dynamo"}, check=True)
    assert "NCCL_SOCKET_IFNAME=lo" in proc.stdout and "TORCH_LOGS=+dynamo" in proc.stdout
    assert "nccl" in proc.stdout and "collect_env" in proc.stdout
    check = multigpu("env", "--check", "--nproc", "2", check=True, timeout=120)
    assert "all-reduce" in check.stdout and "GB/s" in check.stdout and "ok" in check.stdout


def test_the_queue_summary_names_the_best_run_by_its_metric(tmp_path):
    from types import SimpleNamespace

    from multigpu.queue.display import best_line

    def queue(metric: str, values: dict, chosen=None, mode="min") -> SimpleNamespace:
        runs = []
        for name, value in values.items():
            folder = tmp_path / metric / name
            folder.mkdir(parents=True)
            (folder / "metrics.csv").write_text(
                f"step,epoch,{metric}\n10,1,{value * 2}\n20,2,{value}\n"
            )
            runs.append(
                SimpleNamespace(
                    spec=SimpleNamespace(name=name, metric=chosen, mode=mode),
                    state="done",
                    folder=folder,
                )
            )
        return SimpleNamespace(runs=runs, root=tmp_path / metric)

    line = best_line(queue("valid_loss", {"a": 0.5, "b": 0.3, "c": 0.9}))
    assert line.startswith("best run: b (valid_loss 0.3, lowest of 3)") and "multigpu plot" in line
    # The direction is the runs file's mode:, never guessed from the metric's name.
    assert best_line(queue("valid_f1", {"a": 0.5, "b": 0.7}, "valid_f1", "max")).startswith(
        "best run: b"
    )
    assert best_line(queue("valid_err", {"a": 0.5, "b": 0.7}, "valid_err", "max")).startswith(
        "best run: b"
    )
    assert best_line(queue("valid_rmse", {"a": 0.5, "b": 0.7}, "valid_rmse")).startswith(
        "best run: a"
    )
    # no loss, no metric: chosen: no guess
    assert best_line(queue("valid_accuracy", {"a": 0.5, "b": 0.7})) == ""


def test_the_progress_bar_counts_max_steps_when_they_end_the_run_first_in_the_unit_named():
    """max_steps 30 inside a 100-batch epoch: bar and ETA both count to step 30; tokens/s as named."""
    import io
    import time
    from types import SimpleNamespace

    import torch

    from multigpu.trainer.progress import ProgressLine, show_progress

    out = io.StringIO()
    settings = SimpleNamespace(
        max_steps=30, accumulate=1, items_per_sample=256.0, throughput_unit="tokens"
    )
    trainer = SimpleNamespace(
        settings=settings,
        state=SimpleNamespace(global_step=10),
        run=SimpleNamespace(dp_size=2),
        progress=ProgressLine(True, stream=out, every_s=0.0),
    )
    show_progress(trainer, 0, 1, 10, 100, torch.tensor(1.5), 80, 10, time.monotonic() - 1.0)
    line = out.getvalue()
    assert "] step 10/30 loss 1.5" in line and "tokens/s" in line and "ETA 0:02" in line, line
    settings.max_steps = 1000  # the epoch ends first: the epoch's batches
    show_progress(trainer, 0, 1, 10, 100, torch.tensor(1.5), 80, 10, time.monotonic() - 1.0)
    assert "] 10/100 loss" in out.getvalue().splitlines()[-1], out.getvalue()


def test_a_queued_runs_progress_and_eta_reach_the_queues_table(tmp_path):
    """Issue 52, item 8: the queue's table had no per-run progress or ETA. The run's rank 0 keeps its numbers
    in progress.json every couple of seconds (however seldom its log line prints); the table reads them back
    as untrusted, like every file a run writes."""
    import io
    import os
    import time
    from types import SimpleNamespace

    import torch

    from multigpu.queue.display import progress, status_table
    from multigpu.trainer.progress import ProgressLine, show_progress

    out = io.StringIO()
    settings = SimpleNamespace(
        max_steps=30, accumulate=1, items_per_sample=1.0, throughput_unit="samples"
    )
    trainer = SimpleNamespace(
        settings=settings,
        state=SimpleNamespace(global_step=10),
        run=SimpleNamespace(dp_size=1),
        progress=ProgressLine(True, stream=out, every_s=3600, record=str(tmp_path), record_s=0),
    )
    assert trainer.progress.wants_update()  # the record's clock, not the log line's hour
    show_progress(trainer, 0, 1, 10, 100, torch.tensor(1.5), 80, 10, time.monotonic() - 1.0)
    assert out.getvalue() == ""  # the log line keeps its own cadence
    run = SimpleNamespace(
        state="running",
        folder=tmp_path,
        spec=SimpleNamespace(name="a", metric=None),
        slots=["0"],
        share=1,
        elapsed=1.0,
        note="",
    )
    assert progress(run) == "step 10/30 ETA 0:02"
    settings.max_steps = None
    show_progress(trainer, 1, 3, 40, 100, torch.tensor(1.5), 80, 40, time.monotonic() - 4.0)
    assert progress(run) == "epoch 2/3 40/100 ETA 0:16"
    console_text = io.StringIO()
    from rich.console import Console

    Console(file=console_text, width=200).print(
        status_table(SimpleNamespace(root=tmp_path, on_gpus=False, runs=[run]))
    )
    assert "epoch 2/3 40/100 ETA 0:16" in console_text.getvalue()
    assert progress(SimpleNamespace(state="done", folder=tmp_path)) == ""  # only while it runs
    for planted in (
        "[" * 5000,
        '{"done": 1e400, "of": "x", "eta_s": -5, "epoch": true}',
        '"text"',
        "\xff",
    ):
        (tmp_path / "progress.json").write_text(planted, errors="surrogateescape")
        assert progress(run) == "", planted
    (tmp_path / "progress.json").unlink()
    os.mkfifo(tmp_path / "progress.json")  # never a hang of the queue's table
    assert progress(run) == ""
