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
from conftest import (
    PY,
    REPO,
    SCRIPTS,
    child_env,
    multigpu,
    shared_output,
    wait_for_files,
    wait_until_gone,
)

from multigpu import checkpoint

# A test here launches two or three 2-process runs (up to ~1 min each on 2 busy cores); a hang ends here.
pytestmark = pytest.mark.timeout(300)
SCRIPT = str(SCRIPTS / "faults.py")


def _run(
    out: Path, *extra: str, nproc: int = 2, launcher: tuple = ()
) -> subprocess.CompletedProcess:
    return multigpu("run", "--nproc", str(nproc), *launcher, SCRIPT, str(out), *extra)


def _final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=True)


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def faults_reference(factory: pytest.TempPathFactory) -> dict:
    """faults.py uninterrupted on 2 processes, synchronous checkpoints: one launch for the session (the
    asynchronous checkpoint tests compare against it too)."""

    def build(out: Path) -> None:
        proc = _run(out)
        assert proc.returncode == 0, proc.stderr
        assert (out / "steps.txt").read_text() == "18"

    return _final(shared_output(factory, "faults-reference", build))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return faults_reference(tmp_path_factory)


def _background(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "multigpu", "run", "--nproc", "2", SCRIPT, str(out), *extra],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


#: Mid-epoch and at an epoch boundary (6 steps each) one step apart, after it; the last, restarted by the agent.
KILLS = (5, 6, 11, 16)


# Five 2-process launches with the reference's (it is often the first user): up to ~1 min each on 2 busy cores.
@pytest.mark.timeout(900)
def test_kill_at_any_step_then_resume_is_bitwise_equal(tmp_path, reference, no_leftovers):
    """One run killed at each step of KILLS in turn, each attempt resuming from the checkpoint of the step
    the previous one was killed at; the last kill is one the agent restarts from by itself (--max-restarts,
    c10d: a restart once read the previous attempt's store keys in ~1 of 6 runs), and that run finishes:
    bitwise equal to the uninterrupted reference. One launch per kill."""
    kills = ",".join(map(str, KILLS))
    for attempt, kill_at in enumerate(KILLS[:-1]):
        killed = _run(tmp_path, "--kill-at", kills, "--kill-rank", "1", no_leftovers)
        assert killed.returncode != 0, f"not killed at step {kill_at}"
        assert "rank 1 (local rank 1" in killed.stderr and "SIGKILL" in killed.stderr
        assert (tmp_path / f"killed-at-{kill_at}").exists()
        if attempt:  # resumed from the last checkpoint before the previous kill
            assert f"step {KILLS[attempt - 1]})" in killed.stdout, killed.stdout
    resumed = _run(tmp_path, "--kill-at", kills, no_leftovers, launcher=("--max-restarts", "1"))
    assert resumed.returncode == 0, resumed.stderr
    assert (
        tmp_path / f"killed-at-{KILLS[-1]}"
    ).exists() and "Restarting every worker (restart 1 of 1)" in resumed.stderr
    assert f"step {KILLS[-2]})" in resumed.stdout and f"step {KILLS[-1]})" in resumed.stdout, (
        resumed.stdout
    )
    assert _bitwise_equal(_final(tmp_path), reference)


def test_resume_inside_an_epoch_with_accumulation_is_bitwise_equal(tmp_path, no_leftovers):
    """6 batches per epoch, 4 per optimizer step: a resumed epoch must still take its short last step."""
    reference = tmp_path / "reference"
    assert _run(reference, "--accumulate", "4", no_leftovers).returncode == 0
    assert (reference / "steps.txt").read_text() == "6"
    interrupted = tmp_path / "interrupted"  # killed at step 3, restarted by the agent (one launch)
    resumed = _run(
        interrupted,
        "--accumulate",
        "4",
        "--kill-at",
        "3",
        no_leftovers,
        launcher=("--max-restarts", "1"),
    )
    assert resumed.returncode == 0, resumed.stderr
    assert (interrupted / "killed-at-3").exists()
    assert "(epoch 1, batch 4, step 3)" in resumed.stdout
    assert (interrupted / "steps.txt").read_text() == "6"
    assert _bitwise_equal(_final(interrupted), _final(reference))


def test_elastic_restart_after_sigkill_resumes_by_itself_with_a_static_rendezvous(
    tmp_path, reference, no_leftovers
):
    """As the kill chain's last launch (c10d), with a static rendezvous on a port of the test's."""
    from multigpu.launch.ports import reserved_port

    with reserved_port() as held:  # kept from every other process until the launch is over
        proc = _run(
            tmp_path,
            "--kill-at",
            "9",
            no_leftovers,
            launcher=("--max-restarts", "2", "--master-port", str(held)),
        )
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "step 9)" in proc.stdout
    assert _bitwise_equal(_final(tmp_path), reference)


def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_one(
    tmp_path, reference, no_leftovers
):
    """The checkpoint of step 3 blocks inside its write (faults.py --block-save-at): the kill lands mid-write
    every time, not when a poll happens to catch a slow write."""
    launcher = _background(tmp_path, "--block-save-at", "3", no_leftovers)
    try:
        wait_for_files(tmp_path, ["saving"], timeout=120)
        partial = list((tmp_path / "checkpoints").glob(".tmp-step-*"))
        # written, not yet renamed
        assert [p.name.split("-")[2] for p in partial] == ["00000003"], partial
        launcher.kill()  # the workers die with their launcher (parent-death signal)
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
    assert wait_until_gone(str(tmp_path)) == []
    good = checkpoint.latest(tmp_path / "checkpoints")
    assert good.step == 2  # the one before the write that was cut
    resumed = _run(tmp_path, no_leftovers)
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {good.step})" in resumed.stdout
    assert _bitwise_equal(_final(tmp_path), reference)


def test_sigterm_to_the_launcher_checkpoints_and_resumes(tmp_path, reference, no_leftovers):
    """Every rank holds at step 4 until the signal reaches it (faults.py --hold-at): it arrives at a known
    step, however slow the machine, and the run cannot finish before it."""
    launcher = _background(tmp_path, "--hold-at", "4", no_leftovers)
    try:
        wait_for_files(tmp_path, ["held-rank0", "held-rank1"], timeout=120)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    # every worker checkpointed: EXIT_PREEMPTED, "run again to resume"
    assert launcher.returncode == 75, err
    assert "stopped by SIGTERM after step" in out
    stopped_at = int(out.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert checkpoint.latest(tmp_path / "checkpoints").step == stopped_at < 18
    resumed = _run(tmp_path, no_leftovers)
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {stopped_at})" in resumed.stdout
    assert _bitwise_equal(_final(tmp_path), reference)


def test_sigusr1_to_one_worker_stops_every_rank_with_the_preempted_status(tmp_path, no_leftovers):
    """Only rank 1 gets the signal; rank 0 holds at step 3 until rank 1 says it arrived, then trains on:
    the agreement must stop it too."""
    launcher = _background(tmp_path, "--hold-at", "3", no_leftovers)
    try:
        wait_for_files(tmp_path, ["held-rank0", "held-rank1"], timeout=120)
        os.kill(int((tmp_path / "held-rank1").read_text()), signal.SIGUSR1)
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 75, err  # EXIT_PREEMPTED: "try again later"
    assert "stopped by" in out
    assert (tmp_path / "signal-arrived").read_text() == "1"  # rank 0 never received a signal
    assert checkpoint.latest(tmp_path / "checkpoints").step < 18


def test_hang_watchdog_names_the_stuck_rank_and_ends_the_job(tmp_path, no_leftovers):
    """Status 124 comes from the watchdog alone; the collective timeout (60 s, faults.py) would end the job
    with status 1. The idle time each rank reports is measured inside it from the hang on, so a slow
    launch on a busy machine does not count: it must be under that timeout."""
    proc = _run(tmp_path, "--hang-at", "4", "--hang-timeout", "3", no_leftovers)
    assert proc.returncode == 124, proc.stderr
    report = (tmp_path / "hang" / "report.txt").read_text()
    lines = {line.split(":")[0]: line for line in report.splitlines() if line.startswith("rank ")}
    assert "in the data loader" in lines["rank 1"] and "__getitem__" in lines["rank 1"]
    assert "in the data loader" not in lines["rank 0"]
    assert all(
        3 <= int(line.split("no progress for ")[1].split(" s")[0]) < 60 for line in lines.values()
    ), report
    assert "hang detected" in proc.stderr
    # the notice (hang_notice_s 1.5 s) came first, in one line, naming both ranks' places
    notice = next(line for line in proc.stderr.splitlines() if "no training step for" in line)
    assert proc.stderr.index(notice) < proc.stderr.index("hang detected"), proc.stderr
    assert (
        "rank 1 in the data loader" in notice
        and "rank 0 in " in notice
        and "ends the job at 3 s" in notice
    ), notice
    for rank in (0, 1):
        stack = (tmp_path / "hang" / f"rank{rank}.stack").read_text()
        assert "Thread" in stack and "File" in stack  # a real faulthandler dump


def test_ranks_with_different_models_fail_within_seconds_with_a_diff(tmp_path, no_leftovers):
    """The consistency check compares the ranks before any training collective, so nothing waits for the
    collective timeout: its one line (not a timeout's) is what ends the job."""
    proc = _run(tmp_path, "--desync", no_leftovers)
    assert proc.returncode == 1
    assert "ranks disagree before training" in proc.stderr
    assert "parameter_elements: rank 0 = 339, rank 1 = 451" in proc.stderr
    assert "HINT:" in proc.stderr
    assert "Timeout" not in proc.stderr and "timed out" not in proc.stderr


def test_the_exit_status_table_is_what_the_code_uses():
    """docs/fault-tolerance.md's table and multigpu.errors' constants say the same thing."""
    import re

    from multigpu import errors

    page = (REPO / "docs" / "fault-tolerance.md").read_text()
    table = page.split("## Exit statuses", 1)[1].split("\n## ", 1)[0]
    named = {
        m.group(2): int(m.group(1))
        for m in re.finditer(r"^\| (\d+) \| `(EXIT_[A-Z_]+)` \|", table, re.MULTILINE)
    }
    constants = {name: getattr(errors, name) for name in dir(errors) if name.startswith("EXIT_")}
    assert named == constants
    from multigpu.guards.preemption import Preempted
    from multigpu.guards.watchdog import EXIT_HANG

    assert Preempted("x").code == errors.EXIT_PREEMPTED and EXIT_HANG == 124


def test_the_hang_notice_comes_once_per_stall_and_again_after_steps_resume(tmp_path, capfd):
    """In one process (a world of one): a stall with a notice at 0.2 s gives one line; a beat
    and a second stall give a second; the report and exit (timeout 30 s) never come."""
    from multigpu.guards.watchdog import HangWatchdog, _ranks

    exits: list[int] = []

    # what the watchdog printed after at least that long
    def notices(at_least_s: float) -> list[str]:
        time.sleep(at_least_s)
        seen: list[str] = []
        # a busy machine may wake the thread late; never a bound on speed
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            seen += [
                line for line in capfd.readouterr().err.splitlines() if "no training step" in line
            ]
            time.sleep(0.05)
        time.sleep(0.5)  # a second notice for the same stall would come within this
        return seen + [
            line for line in capfd.readouterr().err.splitlines() if "no training step" in line
        ]

    dog = HangWatchdog(
        30.0, tmp_path / "hang", 0, 1, grace_s=0.2, exit=exits.append, notice_s=0.2
    ).start()
    try:
        dog.beat(1)
        first = notices(0.2)
        dog.beat(2)
        second = notices(0.2)
    finally:
        dog.stop()
    assert (
        len(first) == 1
        and "after step 1: rank 0 in user code" in first[0]
        and "at 30 s" in first[0]
    ), first
    assert len(second) == 1 and "after step 2" in second[0], second
    assert not exits and not (tmp_path / "hang" / "report.txt").exists()
    assert _ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7, 8" and _ranks([3]) == "rank 3"
    # a notice after the exit is none
    assert HangWatchdog(5.0, tmp_path, 0, 1, notice_s=60.0).notice_s is None
