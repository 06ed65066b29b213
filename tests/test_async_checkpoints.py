"""Asynchronous checkpoints: a snapshot of the moment they were asked for, at most one in flight, errors
raised where the loop waits, and - with real processes - a SIGKILL during the background write leaves
the previous checkpoint in use while SIGTERM preemption waits for the write and exits resumable."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import PY, SCRIPTS, child_env, multigpu, wait_until_gone
from torch import nn

import multigpu as mg
from multigpu import checkpoint
from multigpu.errors import CheckpointError

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(SCRIPTS / "faults.py")


def test_an_async_checkpoint_is_the_state_when_it_was_asked_for(tmp_path):
    with mg.init(env={}) as run:
        model, opt = run.setup(nn.Linear(64, 64), lambda p: torch.optim.SGD(p, lr=0.1))
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        path = run.save_checkpoint(
            tmp_path, 1, {"model": model, "optimizer": opt}, asynchronous=True
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # training goes on while the write does
        assert run.wait_for_checkpoint() == path
        saved = checkpoint.load_state(path)["model"]
        assert all(torch.equal(saved[k], expected[k]) for k in expected)
        assert run.wait_for_checkpoint() is None  # nothing left in flight


def test_the_next_save_waits_for_the_one_in_flight(tmp_path):
    with mg.init(env={}) as run:
        model, opt = run.setup(nn.Linear(8, 8), lambda p: torch.optim.SGD(p, lr=0.1))
        first = run.save_checkpoint(tmp_path, 1, {"model": model}, asynchronous=True)
        run.save_checkpoint(tmp_path, 2, {"model": model}, asynchronous=True)
        assert first.exists() and checkpoint.verify(first)  # finished before the second began
        run.wait_for_checkpoint()
        assert [i.step for i in checkpoint.list_checkpoints(tmp_path)] == [2, 1]


def test_a_failed_background_write_raises_where_the_loop_waits_and_leaves_nothing(tmp_path):
    class Unpicklable:
        # staged fine, fails only when the background thread pickles it
        def __deepcopy__(self, memo):
            return self

        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with mg.init(env={}) as run:
        model, _ = run.setup(nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1))
        run.save_checkpoint(tmp_path, 1, {"model": model, "bad": Unpicklable()}, asynchronous=True)
        with pytest.raises(CheckpointError, match="was not written"):
            run.wait_for_checkpoint()
    assert checkpoint.list_checkpoints(tmp_path) == [] and not list(tmp_path.glob(".tmp-*"))


def test_close_finishes_the_checkpoint_in_flight(tmp_path):
    run = mg.init(env={})
    model, _ = run.setup(nn.Linear(256, 256), lambda p: torch.optim.SGD(p, lr=0.1))
    path = run.save_checkpoint(tmp_path, 5, {"model": model}, asynchronous=True)
    run.close()
    assert checkpoint.latest(tmp_path).path == path


# ------------------------------------------------------------------------------------------- real processes


def _run(out: Path, *extra: str, launcher: tuple = ()) -> subprocess.CompletedProcess:
    return multigpu("run", "--nproc", "2", *launcher, SCRIPT, str(out), *extra)


def _final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Synchronous checkpoints (the fault tests' reference, one launch for the session): the results must
    not depend on how checkpoints are written."""
    from test_faults import faults_reference

    return faults_reference(tmp_path_factory)


def _background(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            PY,
            "-m",
            "multigpu",
            "run",
            "--nproc",
            "2",
            SCRIPT,
            str(out),
            "--async-checkpoint",
            *extra,
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkill_during_an_async_write_resumes_from_the_previous_one(
    tmp_path, reference, no_leftovers
):
    launcher = _background(tmp_path, "--ballast", "150")
    try:
        # a 150 MB write per step: the first drafts appear within seconds
        deadline = time.monotonic() + 120
        partial = []
        while not partial and time.monotonic() < deadline:
            done = (
                checkpoint.list_checkpoints(tmp_path / "checkpoints")
                if (tmp_path / "checkpoints").is_dir()
                else []
            )
            if done:
                partial = list((tmp_path / "checkpoints").glob(".tmp-step-*"))
            time.sleep(0.01)
        assert partial, "never caught an asynchronous write in flight"
        launcher.kill()  # the workers die with their launcher (parent-death signal), mid-write
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
    assert wait_until_gone(str(tmp_path)) == []
    in_flight = int(partial[0].name.split("-")[2])
    good = checkpoint.latest(tmp_path / "checkpoints")
    assert good is not None and (
        good.step < in_flight or (tmp_path / "checkpoints" / f"step-{in_flight:08d}").exists()
    )
    resumed = _run(tmp_path, "--async-checkpoint")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    assert _equal(_final(tmp_path), reference)


def test_sigterm_waits_for_the_async_write_and_exits_resumable(tmp_path, reference, no_leftovers):
    launcher = _background(tmp_path, "--sleep", "0.1")
    try:
        deadline = time.monotonic() + 120  # 18 steps of 0.1 s: the fourth checkpoint within seconds
        while time.monotonic() < deadline:
            done = (
                checkpoint.list_checkpoints(tmp_path / "checkpoints")
                if (tmp_path / "checkpoints").is_dir()
                else []
            )
            if done and done[0].step >= 4:
                break
            time.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 75, err  # every worker checkpointed: run again to resume
    stopped_at = int(out.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert checkpoint.latest(tmp_path / "checkpoints").step == stopped_at < 18
    assert not list((tmp_path / "checkpoints").glob(".tmp-step-*"))  # no write was abandoned
    resumed = _run(tmp_path, "--async-checkpoint")
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {stopped_at})" in resumed.stdout
    assert _equal(_final(tmp_path), reference)


def test_a_killed_rank_with_async_checkpoints_resumes_bitwise(tmp_path, reference, no_leftovers):
    """Rank 1 dies while step 10 runs; the checkpoint of step 9 may still have been in flight: the
    resume takes the newest one that was finished, and the result is the same. The agent restarts the
    job (one launch: the restart's resume reads the checkpoints as a new launch's would)."""
    resumed = _run(
        tmp_path,
        "--async-checkpoint",
        "--kill-at",
        "9",
        "--kill-rank",
        "1",
        launcher=("--max-restarts", "1"),
    )
    assert resumed.returncode == 0, resumed.stderr
    assert (tmp_path / "killed-at-9").exists()  # the first attempt was killed there
    step = int(resumed.stdout.split("resumed from")[1].split("step ")[1].split(")")[0])
    assert step in (8, 9)
    assert _equal(_final(tmp_path), reference)


def test_the_trainer_reports_each_async_checkpoint_once_it_is_written(tmp_path):
    class Fit(mg.Trainer):
        seen: list = []

        def compute_loss(self, batch):
            return nn.functional.mse_loss(self.model(batch[0]), batch[1])

        def on_checkpoint(self, path):
            self.seen.append((path.name, (path / "manifest.json").exists()))

    data = torch.utils.data.TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    with mg.init(env={}) as run:
        trainer = Fit(
            run,
            nn.Linear(2, 1),
            lambda p: torch.optim.SGD(p, lr=0.1),
            batch_size=4,
            epochs=2,
            checkpoint_every_steps=3,
            out_dir=str(tmp_path),
            progress=False,
            plot=False,
            async_checkpoint=True,
        )
        assert trainer.settings.background_checkpoints(run.device)
        trainer.fit(data)
    from multigpu.trainer.settings import TrainerSettings

    default = TrainerSettings()  # null: in the background on accelerators, synchronous on the CPU
    assert default.background_checkpoints(
        torch.device("cuda", 0)
    ) and not default.background_checkpoints(run.device)
    assert [name for name, _ in trainer.seen] == [
        "step-00000003",
        "step-00000004",
        "step-00000006",
        "step-00000008",
    ]
    assert all(exists for _, exists in trainer.seen)
