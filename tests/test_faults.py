"""Fault tolerance with real processes: exact resume after kills, elastic restarts, preemption signals,
a SIGKILL during a checkpoint write, the hang watchdog, and the desync guard."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import PY, REPO, SCRIPTS, child_env, multigpu, wait_until_gone
from multigpu import checkpoint

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(SCRIPTS / "faults.py")


def _run(out: Path, *extra: str, nproc: int = 2, launcher: tuple = ()) -> subprocess.CompletedProcess:
    return multigpu("run", "--nproc", str(nproc), *launcher, SCRIPT, str(out), *extra)


def _final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=True)


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("reference")
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr
    assert (out / "steps.txt").read_text() == "18"
    return _final(out)


def _background(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "multigpu", "run", "--nproc", "2", SCRIPT, str(out), *extra],
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(out: Path, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = checkpoint.list_checkpoints(out / "checkpoints")
        if done and done[0].step >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint of step {step} within {timeout} s")


@pytest.mark.parametrize("kill_at", [2, 5, 6, 11, 16])  # mid-epoch, at and after epoch boundaries (6 steps each)
def test_kill_at_any_step_then_resume_is_bitwise_equal(tmp_path, reference, kill_at, no_leftovers):
    killed = _run(tmp_path, "--kill-at", str(kill_at), "--kill-rank", "1")
    assert killed.returncode != 0
    assert "rank 1 (local rank 1" in killed.stderr and "SIGKILL" in killed.stderr
    resumed = _run(tmp_path, "--kill-at", str(kill_at))
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {kill_at})" in resumed.stdout  # resumed from the last checkpoint before the kill
    assert _bitwise_equal(_final(tmp_path), reference)


def test_resume_inside_an_epoch_with_accumulation_is_bitwise_equal(tmp_path, no_leftovers):
    """6 batches per epoch, 4 per optimizer step: a resumed epoch must still take its short last step."""
    reference = tmp_path / "reference"
    assert _run(reference, "--accumulate", "4").returncode == 0
    assert (reference / "steps.txt").read_text() == "6"
    interrupted = tmp_path / "interrupted"
    assert _run(interrupted, "--accumulate", "4", "--kill-at", "3").returncode != 0
    resumed = _run(interrupted, "--accumulate", "4", "--kill-at", "3")
    assert resumed.returncode == 0, resumed.stderr
    assert "(epoch 1, batch 4, step 3)" in resumed.stdout
    assert (interrupted / "steps.txt").read_text() == "6"
    assert _bitwise_equal(_final(interrupted), _final(reference))


@pytest.mark.parametrize("rendezvous", ["c10d", "c10d-again", "static"])
def test_elastic_restart_after_sigkill_resumes_by_itself(tmp_path, reference, no_leftovers, rendezvous):
    """Repeated because a restart used to read the previous attempt's store keys in ~1 of 6 runs."""
    from multigpu.launch.ports import free_port

    port = ("--master-port", str(free_port())) if rendezvous == "static" else ()
    proc = _run(tmp_path, "--kill-at", "9", launcher=("--max-restarts", "2", *port))
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "step 9)" in proc.stdout
    assert _bitwise_equal(_final(tmp_path), reference)


def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_path, reference, no_leftovers):
    launcher = _background(tmp_path, "--ballast", "150")
    try:
        _wait_for_step(tmp_path, 3)
        deadline = time.monotonic() + 60
        partial = []
        while not partial and time.monotonic() < deadline:
            partial = list((tmp_path / "checkpoints").glob(".tmp-step-*"))
        assert partial, "never caught a checkpoint being written"
        launcher.kill()  # the workers die with their launcher (parent-death signal)
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
    assert wait_until_gone(str(tmp_path)) == []
    in_flight = int(partial[0].name.split("-")[2])
    good = checkpoint.latest(tmp_path / "checkpoints")
    assert good.step < in_flight or (tmp_path / "checkpoints" / f"step-{in_flight:08d}").exists()
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {good.step})" in resumed.stdout
    assert _bitwise_equal(_final(tmp_path), reference)


def test_sigterm_to_the_launcher_checkpoints_and_resumes(tmp_path, reference, no_leftovers):
    launcher = _background(tmp_path, "--sleep", "0.1")
    try:
        _wait_for_step(tmp_path, 4)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 75  # every worker checkpointed: EXIT_PREEMPTED, "run again to resume"
    assert "stopped by SIGTERM after step" in out
    stopped_at = int(out.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert checkpoint.latest(tmp_path / "checkpoints").step == stopped_at < 18
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {stopped_at})" in resumed.stdout
    assert _bitwise_equal(_final(tmp_path), reference)


def test_sigusr1_to_one_worker_stops_every_rank_with_the_preempted_status(tmp_path, no_leftovers):
    launcher = _background(tmp_path, "--sleep", "0.1")
    try:
        _wait_for_step(tmp_path, 3)
        workers = [int(p) for p in subprocess.run(["pgrep", "-f", f"multigpu.launch.worker {SCRIPT} {tmp_path}"],
                                                    capture_output=True, text=True).stdout.split()]
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGUSR1)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 75, err  # EXIT_PREEMPTED: "try again later"
    assert "stopped by" in out
    assert checkpoint.latest(tmp_path / "checkpoints").step < 18


def test_hang_watchdog_names_the_stuck_rank_and_ends_the_job(tmp_path, no_leftovers):
    started = time.monotonic()
    proc = _run(tmp_path, "--hang-at", "4", "--hang-timeout", "3")
    elapsed = time.monotonic() - started
    assert proc.returncode == 124, proc.stderr
    assert elapsed < 45
    report = (tmp_path / "hang" / "report.txt").read_text()
    lines = {line.split(":")[0]: line for line in report.splitlines() if line.startswith("rank ")}
    assert "in the data loader" in lines["rank 1"] and "__getitem__" in lines["rank 1"]
    assert "in the data loader" not in lines["rank 0"]
    assert "hang detected" in proc.stderr
    for rank in (0, 1):
        stack = (tmp_path / "hang" / f"rank{rank}.stack").read_text()
        assert "Thread" in stack and "File" in stack  # a real faulthandler dump


def test_ranks_with_different_models_fail_within_seconds_with_a_diff(tmp_path, no_leftovers):
    started = time.monotonic()
    proc = _run(tmp_path, "--desync")
    assert proc.returncode == 1
    assert time.monotonic() - started < 30
    assert "ranks disagree before training" in proc.stderr
    assert "parameter_elements: rank 0 = 339, rank 1 = 451" in proc.stderr
    assert "HINT:" in proc.stderr


def test_the_exit_status_table_is_what_the_code_uses():
    """docs/fault-tolerance.md's table and multigpu.errors' constants say the same thing."""
    import re

    from multigpu import errors

    page = (REPO / "docs" / "fault-tolerance.md").read_text()
    table = page.split("## Exit statuses", 1)[1].split("\n## ", 1)[0]
    named = {m.group(2): int(m.group(1)) for m in re.finditer(r"^\| (\d+) \| `(EXIT_[A-Z]+)` \|", table, re.M)}
    constants = {name: getattr(errors, name) for name in dir(errors) if name.startswith("EXIT_")}
    assert named == constants
    from multigpu.guards.preemption import Preempted
    from multigpu.guards.watchdog import EXIT_HANG

    assert Preempted("x").code == errors.EXIT_PREEMPTED and EXIT_HANG == 124
