"""`multigpu check` on a user's script: equal when it is right, and each usual mistake planted in
turn is named by what the check measured (tests/scripts/check_target.py plants them)."""

from __future__ import annotations

import pytest

from conftest import SCRIPTS, multigpu

pytestmark = pytest.mark.timeout(240)
TARGET = str(SCRIPTS / "check_target.py")


@pytest.mark.parametrize("extra", [[], ["--trainer"], ["--plant", "late_optimizer"], ["--plant", "seq_first"],
                                   ["--plant", "plain_backward"]],
                         ids=["own-loop", "trainer", "optimizer-after-setup", "seq-first-input", "loss-backward"])
def test_a_correct_script_is_equal_on_two_processes_and_one(extra):
    proc = multigpu("check", "--nproc", "2", "--steps", "4", TARGET, *extra, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: EQUAL" in proc.stdout and "16 / 16" in proc.stdout
    assert ("(no losses" in proc.stdout) == ("plain_backward" in extra)


@pytest.mark.parametrize("plant, steps, expected", [
    ("unsharded", 3, "every rank trained on the same batches"),
    ("batchnorm", 3, "BatchNorm layer(s) (body.1)"),
    ("sum_loss", 3, "is 1/2 of one process's"),
    ("grad_sum", 3, "the first update on 2 processes is 2x"),
    ("same_seed", 3, "every rank draws the same random numbers"),
    ("unused", 3, "2 parameter(s) got no gradient in step 1 on 2 processes (spare.weight, spare.bias)"),
    ("mean_of_means", 3, "a metric is averaged over the ranks' means"),
    ("drop_last_padding", 7, "step 7: 2 processes saw 6 samples, one process 5"),
])
def test_a_planted_mistake_is_found_and_named(plant, steps, expected):
    proc = multigpu("check", "--nproc", "2", "--steps", str(steps), TARGET, "--plant", plant, timeout=200)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert expected in proc.stdout, proc.stdout
    causes = [line for line in proc.stdout.splitlines() if line.startswith("  - ")]
    assert 1 <= len(causes) <= 2, proc.stdout  # the cause, not a list of every possible one


def test_a_planted_batchnorm_in_the_trainer_is_found():
    proc = multigpu("check", "--nproc", "2", "--steps", "3", TARGET, "--plant", "batchnorm", "--trainer", timeout=200)
    assert proc.returncode == 1 and "BatchNorm" in proc.stdout


def test_a_script_that_never_steps_is_refused_with_a_hint(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('no training here')\n")
    proc = multigpu("check", "--nproc", "2", str(script), timeout=120)
    assert proc.returncode == 2 and "recorded no step" in proc.stdout and "HINT:" in proc.stdout
    bad = multigpu("check", "--nproc", "1", str(script))
    assert bad.returncode == 2 and "multigpu: error: --nproc" in bad.stderr


# ------------------------------------------------------------------ multigpu doctor on this machine


def test_doctor_on_one_machine_reports_a_table_and_the_first_fault(tmp_path):
    healthy = multigpu("doctor", "--nproc", "2", "--out", str(tmp_path), "--sizes", "1,4", timeout=120)
    assert healthy.returncode == 0, healthy.stderr
    assert "shared             ok" in healthy.stdout and "all-reduce 4 MiB   ok" in healthy.stdout
    full = multigpu("doctor", "--nproc", "2", "--out", str(tmp_path), "--sizes", "1", "--checkpoint-gb", "1e9",
                    timeout=120)
    assert full.returncode == 1
    (line,) = [x for x in full.stderr.splitlines() if x.startswith("multigpu: error:")]
    assert "the checkpoints need 1e+09 GB" in line and "HINT:" in line
    bad = multigpu("doctor", "--sizes", "1,lots")
    assert bad.returncode == 2 and "--sizes" in bad.stderr
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    unwritable = multigpu("doctor", "--nproc", "2", "--out", str(blocked / "sub"), "--sizes", "1", timeout=120)
    assert unwritable.returncode == 1 and "is not writable on" in unwritable.stderr  # every rank agreed: no hang
