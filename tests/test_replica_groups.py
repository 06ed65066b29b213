"""Replica groups (``multigpu run --replica-groups R``, strategy ft-ddp, torchft) with real processes.

Every launch runs inside a fresh network namespace that has only loopback (``unshare --net``): torchft
0.2.0's manager server listens on every interface, with no option to change it (docs/security.md), so
the tests give it nothing but loopback to listen on. The lighthouse itself is bound to 127.0.0.1.

What is proved (docs/fault-tolerance.md): a group SIGKILLed in the middle of a step is left out while the
other keeps stepping - never restarted, its step counter never going back, the step the dead group was
part of dropped, the global batch halved while it is gone; the killed group is restarted by its own
agent, heals from the live group and continues at the same step; both end with bitwise-equal weights,
the same step count and the same validation metrics. SIGTERM checkpoints every group (status 75) and the
next run resumes from the newest checkpoint of any group; Ctrl-C then ends everything, lighthouse
included, with no process left. A group built differently fails at its first heal with a diff.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import PY, SCRIPTS, child_env

pytest.importorskip(
    "torchft",
    reason="replica groups need torchft (pip install 'multigpu[ft]'; the test extra has it)",
)
SCRIPT = str(SCRIPTS / "replicas.py")
STARTS = ["-m", "multigpu", "run", "--replica-groups", "2", "--heartbeat-timeout", "1"]


@pytest.fixture(scope="module")
def isolated() -> list[str]:
    """The argv prefix that runs a command in a network namespace of its own with only ``lo`` up."""
    if shutil.which("unshare") and shutil.which("ip"):
        for prefix in (["unshare", "--net"], ["unshare", "--net", "--map-root-user"]):
            if (
                subprocess.run(
                    [*prefix, "ip", "link", "set", "lo", "up"], capture_output=True
                ).returncode
                == 0
            ):
                return [*prefix, "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    pytest.skip(
        "needs a network namespace of its own (unshare --net as root, or user namespaces) and iproute2"
    )


def _records(out: Path, group: int) -> list[dict]:
    path = out / f"steps-g{group}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_steps(out: Path, count: int, pids: set, timeout: float = 150) -> None:
    """Until every group has finished ``count`` batches in a process not in ``pids`` (this launch's)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(len([r for r in _records(out, g) if r["pid"] not in pids]) >= count for g in (0, 1)):
            return
        time.sleep(0.2)
    raise AssertionError(f"the groups did not reach {count} batches within {timeout} s")


def _newest_step(folder: Path) -> int:
    return max(int(path.name.split("-")[1]) for path in folder.glob("step-*"))


# Two groups start (a few seconds each on 2 cores), one is killed and restarted by its agent (process start
# plus torch import: the longest part), then three short epochs: well under the limit even on a loaded machine.
@pytest.mark.timeout(240)
def test_a_killed_group_is_left_out_then_heals_while_the_other_keeps_stepping(
    tmp_path, isolated, no_leftovers
):
    out = tmp_path / no_leftovers
    out.mkdir()
    proc = subprocess.run(
        [
            *isolated,
            PY,
            *STARTS,
            "--max-restarts",
            "1",
            SCRIPT,
            str(out),
            "--epochs",
            "3",
            "--kill-at",
            "5",
            "--hold",
            "0.1",
            "--wait-restart-at",
            "20",
            "--valid",
            "--final-checkpoint-only",
            "--rejoin-after-alone",
        ],
        capture_output=True,
        text=True,
        timeout=230,
        env=child_env(),
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    survivor, killed = _records(out, 0), _records(out, 1)
    # The survivor: never restarted, its counter never went back, the step group 1 died in was dropped ...
    assert {r["attempt"] for r in survivor} == {0}
    steps = [r["step"] for r in survivor]
    assert steps == sorted(steps)
    assert "step 6 was not committed by every live group" in said
    # ... and it went on alone, with half the global batch, until group 1 was back.
    alone = [r["step"] for r in survivor if r["live"] == 1]
    # (How many steps it trained alone depends on how fast group 1 restarts; --rejoin-after-alone makes it at
    # least one, --wait-restart-at makes sure group 1 comes back before the end.)
    assert min(alone) == 6 and alone == list(range(6, max(alone) + 1))
    assert "1 of 2 replica group(s) live, global batch 8 of 16" in said
    assert survivor[-1]["live"] == 2
    # Group 1: restarted by its agent with nothing on disk, it healed from group 0 and continued at its step.
    back = [r for r in killed if r["attempt"] == 1]
    assert back and back[0]["step"] > max(alone)
    assert "replica group 1 healed from a live peer" in said
    weights = {r["step"]: r["digest"] for r in survivor}
    assert all(weights[r["step"]] == r["digest"] for r in back)
    # The end: the same weights, bit for bit, the same step count and the same validation metrics.
    final = [torch.load(out / f"final-g{g}.pt", weights_only=True) for g in (0, 1)]
    assert final[0].keys() == final[1].keys() and all(
        torch.equal(final[0][k], final[1][k]) for k in final[0]
    )
    done = [json.loads((out / f"done-g{g}").read_text()) for g in (0, 1)]
    assert done[0]["step"] == done[1]["step"] == 3 * 16 - 1  # 48 batches, one dropped
    assert done[0]["history"][-1]["valid_loss"] == done[1]["history"][-1]["valid_loss"]
    assert (out / "run" / "replica-groups-finished.json").exists()


# Three launches' worth of start-up: the preempted run, then the resumed one that Ctrl-C ends.
@pytest.mark.timeout(300)
def test_sigterm_checkpoints_every_group_the_rerun_resumes_and_ctrl_c_ends_everything(
    tmp_path, isolated, no_leftovers
):
    out = tmp_path / no_leftovers
    out.mkdir()
    command = [*isolated, PY, *STARTS, SCRIPT, str(out), "--epochs", "20", "--sleep", "0.05"]
    first = subprocess.Popen(
        command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for_steps(out, 4, set())
        first.send_signal(signal.SIGTERM)
        err = "".join(first.communicate(timeout=150))
    finally:
        first.kill()
    assert first.returncode == 75, err[-3000:]
    assert "every replica group wrote its checkpoint and stopped" in err
    saved = [_newest_step(out / "run" / f"replica-group-{g}" / "checkpoints") for g in (0, 1)]
    assert min(saved) >= 4
    before = {r["pid"] for g in (0, 1) for r in _records(out, g)}

    second = subprocess.Popen(
        command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for_steps(out, 3, before)
        second.send_signal(signal.SIGINT)
        err = "".join(second.communicate(timeout=150))
    finally:
        second.kill()
    assert second.returncode == 130, err[-3000:]
    assert "stopped by SIGINT: every replica group and the lighthouse were stopped" in err
    # "resumed from .../step-N (epoch e, batch b, step N)": the newest of all
    assert f"step {max(saved)})" in err
    resumed = [r["step"] for g in (0, 1) for r in _records(out, g) if r["pid"] not in before]
    assert min(resumed) == max(saved) + 1  # not one step trained twice, none skipped
    # no_leftovers: no worker, agent or tee process is left, and the lighthouse lived in the launcher


# Two groups start; one fails at its first heal (no restarts), the other trains 4 steps alone.
@pytest.mark.timeout(200)
def test_a_group_built_differently_fails_at_its_first_heal_with_a_diff(
    tmp_path, isolated, no_leftovers
):
    out = tmp_path / no_leftovers
    out.mkdir()
    proc = subprocess.run(
        [*isolated, PY, *STARTS, SCRIPT, str(out), "--epochs", "1", "--samples", "64", "--wider"],
        capture_output=True,
        text=True,
        timeout=190,
        env=child_env(),
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("multigpu: error:")]
    assert len(errors) == 1 and "differs from the live group it heals from" in errors[0], (
        proc.stderr[-3000:]
    )
    assert "parameter_elements: live group = " in errors[0] and "HINT:" in errors[0]
    assert "Traceback" not in proc.stderr
    # the other group finished the job
    assert proc.returncode == 0 and "had failed for good" in proc.stderr
    assert "step 1: 1 of 2 replica group(s) live" in proc.stdout
