"""`multigpu check` on a user's script: EQUAL only when it is right, and every planted bug - each one
that real programs have - is caught and named by what the check measured.

The mutation table (tests/scripts/check_mutants.py) runs every case of a run in one launch: one
2-process launch and one 1-process launch record all cases with the check's own recorder, and the
check's own report compares them case by case (~30 s for 30 cases instead of ~15 s per case). The
cases that need a launch of their own (a rank that stops stepping, the command line itself, the
nanoGPT example) run through `multigpu check` end to end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import (
    PY,
    REPO,
    SCRIPTS,
    child_env,
    kill_all,
    listening,
    multigpu,
    wait_for_files,
    wait_until_gone,
)

pytestmark = pytest.mark.timeout(300)
MUTANTS = str(SCRIPTS / "check_mutants.py")
STEPS = 3

#: Distinctive words of each cause the check can name.
CAUSES = {
    "rank_steps": "stepped the optimizer",
    "inputs": "trained on identical inputs",
    "unscaled": "its batch was not scaled",
    "accumulation": "micro-steps per optimizer step depend on the number of processes",
    "batch": "batch per process depends on the number of processes",
    "padding": "drop_last or the sampler's padding",
    "batchnorm": "BatchNorm layer(s)",
    "summed_loss": "is 1/2 of one process's",
    "scaled_update": "the first update on 2 processes is",
    "random": "every rank draws the same random numbers",
    "never_synced": "ran under no_sync",
    "last_unsynced": "ran without gradient sync while an earlier one synced",
    "bypass": "around the object run.setup returned",
    "outside": "not in the model given to run.setup",
    "diverged": "the ranks' weights differ",
    "unused": "got no gradient",
    "clip": "clipped while still multiplied by the GradScaler's scale",
    "scheduler": "LR scheduler stepped 2 times per optimizer step",
    "metric": "a metric is averaged over the ranks' means",
    "unverified": "no sample was counted",
    "still_weights": "no weight changed in",
    "still_loss": "at every one of",
}

#: bug -> (the verdict, exactly the causes it must name). "EQUAL numbers" (exit 1): both runs make the
#: mistake, so the numbers agree, but it is wrong on any number of processes.
BUGS = {
    "get_batch_one_seed": ("DIFFERENT", {"inputs", "unscaled", "random"}),
    "accum_div_world": ("DIFFERENT", {"accumulation"}),
    "batch_div_world": ("DIFFERENT", {"batch"}),
    "sum_loss": ("DIFFERENT", {"summed_loss", "scaled_update"}),
    "loss_div_world": ("DIFFERENT", {"summed_loss", "scaled_update"}),
    "grad_sum": ("DIFFERENT", {"scaled_update"}),
    "batchnorm": ("DIFFERENT", {"batchnorm"}),
    "mean_of_means": ("EQUAL numbers", {"metric"}),
    "plain_loader": ("DIFFERENT", {"inputs", "unscaled"}),
    "clip_before_unscale": ("EQUAL numbers", {"clip"}),
    "scheduler_per_micro": ("EQUAL numbers", {"scheduler"}),
    "dropout_one_generator": ("DIFFERENT", {"random"}),
    "noise_same_seed": ("DIFFERENT", {"random"}),
    "no_sync_always": ("DIFFERENT", {"never_synced"}),
    "sync_toggle_wrong": ("DIFFERENT", {"last_unsynced"}),
    "late_layer": ("DIFFERENT", {"outside"}),
    "bypass_wrapper": ("DIFFERENT", {"bypass"}),
    "unused": ("DIFFERENT", {"unused"}),
    "drop_last_padding": ("DIFFERENT", {"padding"}),
}
CORRECT = [
    "none",
    "late_optimizer",
    "seq_first",
    "plain_backward",
    "accumulate",
    "nanogpt_toggle",
    "amp_clip",
    "scheduler_per_step",
    "trainer",
]
EXIT = {"EQUAL": 0, "DIFFERENT": 1, "EQUAL numbers": 1, "UNVERIFIED": 3}


def named(report: str) -> set[str]:
    """The causes a report names, by their distinctive words."""
    listed = "\n".join(line for line in report.splitlines() if line.startswith("  - "))
    return {key for key, words in CAUSES.items() if words in listed}


def verdict(report: str) -> str:
    line = next(line for line in report.splitlines() if line.startswith("verdict: "))
    return "EQUAL numbers" if line.startswith("verdict: EQUAL numbers") else line.split()[1]


def _launch(
    nproc: int, scale: int, cases: list[str], records: Path, token: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            PY,
            "-m",
            "multigpu",
            "run",
            "--nproc",
            str(nproc),
            "--tee-prefix",
            "never",
            MUTANTS,
            "--table",
            ",".join(cases),
            "--records",
            str(records),
            "--steps",
            str(STEPS),
            "--scale",
            str(scale),
            token,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(),
        cwd=str(REPO),
    )


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every case's (exit status, report), from one 2-process and one 1-process launch."""
    from multigpu.diagnostics import check

    root = tmp_path_factory.mktemp("mutants")
    cases = [
        *BUGS,
        *CORRECT,
        "opaque_inputs",
        "per_rank_generator",
        "zero_loss",
        "zero_lr",
        "nan_loss",
    ]
    token = f"mgtest-table-{time.monotonic_ns()}"
    started = time.monotonic()
    try:
        for nproc, scale in ((2, 1), (1, 2)):
            proc = _launch(nproc, scale, cases, root / f"n{nproc}", token)
            assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        left = wait_until_gone(token, timeout=15)
        kill_all(left)
    assert not left, f"processes left behind: {left}"

    def outcome(folder: Path):
        statuses = [json.loads(p.read_text()) for p in sorted(folder.glob("status.rank*.json"))]
        return check.Outcome.read(
            folder,
            max(s["status"] for s in statuses),
            "\n".join(s["error"] for s in statuses if s["error"]),
        )

    reports = {}
    for case in cases:
        lines: list[str] = []
        code = check.report(
            outcome(root / "n2" / case), outcome(root / "n1" / case), 2, STEPS, None, lines.append
        )
        reports[case] = (code, "\n".join(lines))
    print(f"mutation table: {len(cases)} cases in {time.monotonic() - started:.1f} s")
    return reports


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_is_caught_and_named(table, bug):
    code, report = table[bug]
    expected_verdict, expected_causes = BUGS[bug]
    assert verdict(report) == expected_verdict and code == EXIT[expected_verdict], report
    assert named(report) == expected_causes, report
    # the case: run.loader built, a plain DataLoader used - every rank
    if bug == "plain_loader":
        # trains on the same data: 8 distinct of 16
        assert re.search(r"^\s+1 .* 16 / 8$", report, re.M), report


@pytest.mark.parametrize("variant", CORRECT)
def test_a_correct_variant_is_equal(table, variant):
    code, report = table[variant]
    assert code == 0 and "verdict: EQUAL - 2 processes compute what 1 process computes" in report, (
        report
    )
    assert not named(report), report
    # samples counted in both runs
    assert re.search(r"^\s+1 .* (16 / 16|32 / 32)$", report, re.M), report


def test_the_loss_shown_is_the_scripts_own_undivided_by_accumulation(table):
    """Accumulating over 2 micro-steps with loss / 2 (nanoGPT, the Trainer): the step's loss is their
    sum - the cross-entropy of 3 classes at initialisation, ~1.1, not ~0.55."""
    for variant in ("accumulate", "nanogpt_toggle", "trainer"):
        first = next(line for line in table[variant][1].splitlines() if re.match(r"\s+1\s", line))
        many, one = float(first.split()[1]), float(first.split()[2])
        assert 0.9 < many < 1.4 and 0.9 < one < 1.4, table[variant][1]
    assert (
        "2 processes x 2 micro-step(s) x 8 samples = 32   |   1 process x 2 micro-step(s) x 16 samples = 32"
        in table["accumulate"][1]
    )


def test_a_world_size_dependent_accumulation_shows_both_global_batches(table):
    assert (
        "2 processes x 1 micro-step(s) x 8 samples = 16   |   1 process x 2 micro-step(s) x 16 samples = 32"
        in table["accum_div_world"][1]
    )


def test_a_script_whose_inputs_cannot_be_seen_is_unverified(table):
    code, report = table["opaque_inputs"]
    assert code == 3 and verdict(report) == "UNVERIFIED" and named(report) == {"unverified"}, report


def test_a_script_that_trains_nothing_is_unverified_never_equal(table):
    """The PyTorch DDP tutorial's toy loss is always 0: 2 processes and 1 agree exactly, and prove nothing."""
    code, report = table["zero_loss"]
    assert (
        code == 3
        and verdict(report) == "UNVERIFIED"
        and named(report) == {"still_weights", "still_loss"}
    ), report
    assert "the loss was 0 at every one of 3 steps" in report
    code, report = table["zero_lr"]  # the losses move with the batches; the weights do not
    assert code == 3 and verdict(report) == "UNVERIFIED" and named(report) == {"still_weights"}, (
        report
    )
    code, report = table["nan_loss"]  # NaN in both runs: not "NaN in one run only", not DIFFERENT
    assert code == 3 and "the loss is NaN or infinite in both runs from step 1" in report, report


def test_batches_made_by_hand_with_a_generator_per_rank_are_named_as_unscaled(table):
    """Right for training (every rank its own offsets), but the one-process run cannot get 2x the batch:
    the check must say so - and not that the data is unsharded."""
    code, report = table["per_rank_generator"]
    assert code == 1 and verdict(report) == "DIFFERENT" and named(report) == {"unscaled"}, report


# ------------------------------------------------------------------ end to end, through the command line


def test_a_correct_script_is_equal_and_its_own_output_is_shown(no_leftovers):
    proc = multigpu(
        "check",
        "--nproc",
        "2",
        "--steps",
        str(STEPS),
        "--show-output",
        MUTANTS,
        no_leftovers,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: EQUAL - 2 processes compute" in proc.stdout
    assert "check_mutants: training with bug 'none' on 2 process(es)" in proc.stdout
    assert "check_mutants: training with bug 'none' on 1 process(es)" in proc.stdout


def test_an_optimizer_step_on_rank_0_only_is_named(no_leftovers):
    """Rank 1 never steps: rank 0 stops at step K, sees rank 1 go past without stepping, and leaves
    without the goodbye barrier; rank 1's next all-reduce fails at once instead of waiting."""
    proc = multigpu(
        "check",
        "--nproc",
        "2",
        "--steps",
        str(STEPS),
        MUTANTS,
        "--bug",
        "rank0_step",
        no_leftovers,
        timeout=200,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "rank(s) 1 stepped the optimizer 0 time(s) while rank(s) 0 stepped it 3 time(s)"
        in proc.stdout
    )
    assert named(proc.stdout) == {"rank_steps"}, proc.stdout


def test_a_script_that_never_steps_is_refused_with_a_hint(tmp_path, no_leftovers):
    script = tmp_path / "plain.py"
    script.write_text("import multigpu as mg\n\nrun = mg.init()\nprint('no training here')\n")
    proc = multigpu("check", "--nproc", "2", str(script), no_leftovers, timeout=120)
    assert (
        proc.returncode == 2
        and "recorded no step (exit 0): it ran, but no optimizer step" in proc.stdout
    )
    assert "HINT:" in proc.stdout, proc.stdout
    bad = multigpu("check", "--nproc", "1", str(script))
    assert bad.returncode == 2 and "multigpu: error: --nproc" in bad.stderr


def test_the_nanogpt_port_trains_on_two_processes_and_checks_equal(tmp_path, no_leftovers):
    """examples/nanogpt: a few iterations on 2 CPU processes (evaluation, a checkpoint, a resume),
    then `multigpu check` says EQUAL."""
    train = str(REPO / "examples" / "nanogpt" / "train.py")
    data, out = f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / no_leftovers}"
    first = multigpu(
        "run", "--nproc", "2", train, data, out, "--max_iters=2", "--eval_interval=2", timeout=200
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert (
        "step 2: train loss" in first.stdout
        and "saved a checkpoint" in first.stdout
        and "sample:" in first.stdout
    )
    resumed = multigpu(
        "run",
        "--nproc",
        "2",
        train,
        data,
        out,
        "--max_iters=3",
        "--eval_interval=2",
        "--log_interval=1",
        "--init_from=resume",
        timeout=200,
    )
    assert resumed.returncode == 0 and "iter 2: loss" in resumed.stdout, (
        resumed.stdout + resumed.stderr
    )
    proc = multigpu("check", "--nproc", "2", "--steps", str(STEPS), train, data, out, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: EQUAL - 2 processes compute" in proc.stdout
    assert (
        "2 processes x 2 micro-step(s) x 8 samples = 32   |   1 process x 2 micro-step(s) x 16 samples = 32"
        in proc.stdout
    )


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "SIGKILL"])
def test_a_stopped_check_leaves_no_run_behind(tmp_path, no_leftovers, how):
    """A check stopped while its run trains (a script that never ends): SIGTERM to it alone (a scheduler,
    `timeout`), SIGINT to its process group (a terminal's Ctrl-C) or SIGKILL. Its run's launcher and
    workers stop (a SIGKILLed check's through the kernel: its children ask for SIGTERM when it dies), and
    only a SIGKILL may leave its own folder. Before, a SIGTERM left the run training forever."""
    temp = Path(tempfile.mkdtemp(prefix="mgt-", dir="/tmp"))
    check = subprocess.Popen(
        [
            PY,
            "-m",
            "multigpu",
            "check",
            "--nproc",
            "2",
            str(SCRIPTS / "sleeper.py"),
            str(tmp_path),
            no_leftovers,
        ],
        env=child_env({"TMPDIR": str(temp)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # as from a shell
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        # (the three waits within the file's 300 s)
        wait_for_files(tmp_path, ["pid0", "pid1"], timeout=100)
        if how == "Ctrl-C":
            os.killpg(check.pid, signal.SIGINT)
        else:
            check.send_signal(getattr(signal, how))
        # the bound of a hang: the launcher stops its workers in seconds
        _, err = check.communicate(timeout=90)
        # each removes its folders before it leaves
        assert wait_until_gone(no_leftovers, timeout=80) == []
        left = [p.name for p in temp.iterdir() if p.name.startswith("multigpu-")]
    finally:
        check.kill()
        shutil.rmtree(temp, ignore_errors=True)
    assert check.returncode == {"SIGTERM": 143, "Ctrl-C": 130, "SIGKILL": -9}[how], err
    assert "Traceback" not in err
    if how == "SIGKILL":
        assert len(left) == 1 and left[0].startswith("multigpu-check-"), left
    else:
        assert left == [], left
        assert err.splitlines()[-1] == (
            "multigpu: interrupted" if how == "Ctrl-C" else "multigpu: stopped by SIGTERM"
        )


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "--timeout"])
def test_a_stopped_doctor_leaves_no_launch_behind(tmp_path, no_leftovers, how):
    """A doctor stopped while its launch waits for a second node that never comes (static rendezvous: the
    launcher waits inside C++, where no Python handler runs): SIGTERM to it alone (a scheduler, `timeout`)
    or SIGINT to its process group (a terminal's Ctrl-C; the launch, in a session of its own, gets the
    stop from doctor, once), or its own --timeout (it stops the launch with SIGTERM, wherever the launch
    then is: the outcome does not depend on how far it got). The launcher says what stopped it, doctor ends
    with its own line and status, and nothing is left: no process, no folder. 90 s: the bound of a hang
    (it ends in seconds)."""
    from multigpu.launch.ports import reserved_port

    temp = Path(tempfile.mkdtemp(prefix="mgt-", dir="/tmp"))
    with reserved_port() as port:
        doctor = subprocess.Popen(
            [
                PY,
                "-m",
                "multigpu",
                "doctor",
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                "0",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--rdzv-timeout",
                "300",
                "--sizes",
                "1",
                *(["--timeout", "8"] if how == "--timeout" else []),
                # the token on every command line of the launch
                "--out",
                str(tmp_path / no_leftovers),
            ],
            env=child_env({"TMPDIR": str(temp)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            if how != "--timeout":
                deadline = time.monotonic() + 120
                while not listening(port) and doctor.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert listening(port), "the launcher's store never listened"
            if how == "Ctrl-C":
                os.killpg(doctor.pid, signal.SIGINT)
            elif how == "SIGTERM":
                doctor.send_signal(signal.SIGTERM)
            _, err = doctor.communicate(timeout=90)
            assert wait_until_gone(no_leftovers, timeout=30) == []
            left = [p.name for p in temp.iterdir()]
        finally:
            doctor.kill()
            shutil.rmtree(temp, ignore_errors=True)
    assert "Traceback" not in err and left == [], (err, left)
    if how == "--timeout":
        assert doctor.returncode == 2, err  # (a LaunchError)
        # the launcher's line (while waiting, or before)
        assert "multigpu: stopped by SIGTERM" in err
        assert err.splitlines()[-1].startswith("multigpu: error: doctor did not finish in 8 s"), err
        return
    sig = "SIGINT" if how == "Ctrl-C" else "SIGTERM"
    assert doctor.returncode == (130 if how == "Ctrl-C" else 143), err
    assert (
        f"multigpu: stopped by {sig} while waiting for the other nodes; no worker had started."
        in err
    )
    assert err.splitlines()[-1] == (
        "multigpu: interrupted" if how == "Ctrl-C" else "multigpu: stopped by SIGTERM"
    )


def test_a_bad_nanogpt_setting_is_one_line(tmp_path):
    proc = multigpu(
        "run",
        "--nproc",
        "1",
        str(REPO / "examples" / "nanogpt" / "train.py"),
        "--max_itres=3",
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("multigpu: error:")]
    assert "--max_itres is not a setting" in line and "HINT:" in line


# ------------------------------------------------------------------ multigpu doctor on this machine


def test_doctor_on_one_machine_reports_a_table_and_the_first_fault(tmp_path):
    healthy = multigpu(
        "doctor", "--nproc", "2", "--out", str(tmp_path), "--sizes", "1,4", timeout=120
    )
    assert healthy.returncode == 0, healthy.stderr
    assert "shared             ok" in healthy.stdout and "all-reduce 4 MiB   ok" in healthy.stdout
    full = multigpu(
        "doctor",
        "--nproc",
        "2",
        "--out",
        str(tmp_path),
        "--sizes",
        "1",
        "--checkpoint-gb",
        "1e9",
        timeout=120,
    )
    assert full.returncode == 1
    (line,) = [x for x in full.stderr.splitlines() if x.startswith("multigpu: error:")]
    assert "the checkpoints need 1e+09 GB" in line and "HINT:" in line
    bad = multigpu("doctor", "--sizes", "1,lots")
    assert bad.returncode == 2 and "--sizes" in bad.stderr
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    unwritable = multigpu(
        "doctor", "--nproc", "2", "--out", str(blocked / "sub"), "--sizes", "1", timeout=120
    )
    # every rank agreed: no hang
    assert unwritable.returncode == 1 and "is not writable on" in unwritable.stderr


def test_a_script_that_sets_up_its_own_ddp_is_told_why_check_cannot_compare_it(tmp_path):
    """The PyTorch DDP tutorial's multigpu_torchrun.py never calls mg.init: exit 2 with the reason and
    what to do, not a line of its output quoted as an error."""
    shutil.copytree(SCRIPTS / "ddp_tutorial", tmp_path / "tutorial")
    proc = multigpu(
        "check",
        "--nproc",
        "2",
        "--steps",
        "2",
        "multigpu_torchrun.py",
        "2",
        "1",
        cwd=tmp_path / "tutorial",
        timeout=180,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "finished (exit 0) without calling mg.init()" in proc.stdout
        and "HINT: such a script runs unchanged" in proc.stdout
    ), proc.stdout
