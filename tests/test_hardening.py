"""Regression tests for the hardening of input from others: each reproduces an input that got through
before (a crash, a folder renamed or replaced, a job submitted twice, a live table left broken)."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import PY, REPO, SCRIPTS, child_env, multigpu, multigpu_here, wait_for_files
from rich.console import Console
from torch import nn

from multigpu import checkpoint
from multigpu.checkpoint.files import MANIFEST, finalize_folder, save_state, step_name
from multigpu.errors import ConfigError, LaunchError
from multigpu.queue.display import status_table
from multigpu.queue.lock import RunLock
from multigpu.queue.run_folder import decide
from multigpu.queue.runs import QueueEntry
from multigpu.queue.scheduler import EntryState

# Queues of short runs and small subprocesses (each under a minute on 2 busy cores); a stuck one ends here.
pytestmark = pytest.mark.timeout(180)
SLEEP = str(SCRIPTS / "sleep_run.py")


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}}


# ------------------------------------------------------------------ checkpoints


def test_a_crash_between_the_two_renames_of_a_replacement_is_recovered(tmp_path, monkeypatch):
    """Saving step 5 again moves the old folder aside, then renames the new one in. A crash between
    the two used to leave the only copy as .old-step-*, which the next prune deleted."""
    save_state(tmp_path, 5, _state(1.0))
    from multigpu.fileio import Folder

    real_rename = Folder.move
    calls = []

    def crash_on_second(self, source, target):
        calls.append(Path(target).name)
        if len(calls) == 2:
            raise KeyboardInterrupt("power cut")
        return real_rename(self, source, target)

    monkeypatch.setattr(Folder, "move", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        save_state(tmp_path, 5, _state(2.0))
    monkeypatch.setattr(Folder, "move", real_rename)
    assert not (tmp_path / step_name(5)).exists() and any(
        p.name.startswith(".old-step-") for p in tmp_path.iterdir()
    )
    checkpoint.prune(tmp_path, keep_last=1, newest=5)  # what the next save does first
    info = checkpoint.latest(tmp_path)
    assert info is not None and info.step == 5
    # the old copy, whole
    assert torch.equal(checkpoint.load_state(info.path)["model"]["w"], torch.ones(3))


def test_a_crash_after_the_replacement_leaves_no_stale_copy(tmp_path):
    save_state(tmp_path, 5, _state(2.0))
    aside = tmp_path / ".old-step-00000005-deadbeef"
    (aside).mkdir()
    (aside / "state.pt").write_bytes(b"old")
    reports = []
    # what a resume does first (checkpoint.latest itself only reads)
    checkpoint.files.recover(tmp_path)
    info = checkpoint.latest(tmp_path, report=reports.append)
    assert info.step == 5 and not aside.exists() and not reports
    assert torch.equal(checkpoint.load_state(info.path)["model"]["w"], torch.full((3,), 2.0))


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda m: m.__setitem__("files", ["state.pt"]), "no 'files' mapping"),
        (lambda m: m["files"]["state.pt"].pop("xxh3"), "8-digit hex 'crc32'"),
        (lambda m: m.__setitem__("files", {}), "does not list state.pt"),
        (
            lambda m: m["files"].__setitem__("../../x", {"size": 1, "crc32": "00000000"}),
            "not inside the checkpoint",
        ),
    ],
)
def test_a_resume_skips_a_malformed_manifest_as_corrupt(tmp_path, change, why):
    """Used to crash the Trainer's resume (and verify/list/consolidate) with a KeyError or TypeError."""
    save_state(tmp_path, 1, _state(1.0))
    bad = save_state(tmp_path, 2, _state(2.0))
    manifest = json.loads((bad / MANIFEST).read_text())
    change(manifest)
    (bad / MANIFEST).write_text(json.dumps(manifest))
    reports = []
    info = checkpoint.latest(tmp_path, report=reports.append)
    assert info.step == 1 and len(reports) == 1 and why in reports[0]
    listing = multigpu_here("checkpoint", "list", str(tmp_path))
    assert (
        listing.returncode == 0
        and "CORRUPT" in listing.stdout
        and "Traceback" not in listing.stderr
    )


def test_the_trainer_resumes_past_a_malformed_checkpoint(tmp_path):
    import multigpu as mg

    class Fit(mg.Trainer):
        def compute_loss(self, batch):
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

    data = torch.utils.data.TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    with mg.init(env={}) as run:
        trainer = Fit(
            run,
            nn.Linear(2, 1),
            lambda p: torch.optim.SGD(p, lr=0.1),
            batch_size=4,
            epochs=2,
            out_dir=str(tmp_path),
            progress=False,
        )
        trainer.fit(data)
    newest = max((tmp_path / "checkpoints").glob("step-*"))
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["files"] = ["state.pt"]
    (newest / MANIFEST).write_text(json.dumps(manifest))
    with mg.init(env={}) as run:
        trainer = Fit(
            run,
            nn.Linear(2, 1),
            lambda p: torch.optim.SGD(p, lr=0.1),
            batch_size=4,
            epochs=2,
            out_dir=str(tmp_path),
            progress=False,
        )
        assert trainer.resume() and trainer.state.global_step == 4  # the epoch-1 checkpoint


def test_consolidate_never_replaces_the_source(tmp_path):
    """`consolidate STEP --out <its parent>` used to replace the sharded step with a partial one."""
    from multigpu.checkpoint import sharded

    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    step = sharded.save(
        tmp_path, 4, model, opt, {"trainer": {}}, is_main=True, barrier=lambda: None
    )
    before = {p.name: p.stat().st_mtime_ns for p in step.iterdir()}
    proc = multigpu_here("checkpoint", "consolidate", str(step), "--out", str(tmp_path))
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in step.iterdir()} == before
    assert checkpoint.verify(step)["sharded"] is True


def test_finalize_never_overwrites_when_told_not_to(tmp_path):
    save_state(tmp_path, 1, _state(1.0))
    tmp = tmp_path / ".tmp-step-00000001-x"
    tmp.mkdir()
    torch.save(_state(9.0), tmp / "state.pt")
    with pytest.raises(Exception, match="already exists"):
        finalize_folder(tmp, 1, overwrite=False)
    assert torch.equal(checkpoint.load_state(tmp_path / step_name(1))["model"]["w"], torch.ones(3))


# ------------------------------------------------------------------ queue: locks, decisions, display


def test_decide_follows_the_same_rules_for_local_and_slurm(tmp_path):
    folder = tmp_path / "run"
    assert decide(folder, "f1").action == "start"
    folder.mkdir()
    (folder / "status.json").write_text(json.dumps({"state": "done", "fingerprint": "f1"}))
    assert decide(folder, "f1").action == "skip"
    assert decide(folder, "f2").action == "fresh"
    (folder / "status.json").write_text(
        json.dumps({"state": "submitted", "job_id": "7", "fingerprint": "f1"})
    )
    assert decide(folder, "f1", active_job=lambda job: True).action == "skip"
    assert "already submitted as job 7" in decide(folder, "f1", active_job=lambda job: True).note
    assert decide(folder, "f1", active_job=lambda job: False).action == "resume"
    with pytest.raises(ConfigError, match="still queued or running"):
        decide(folder, "f2", active_job=lambda job: True)
    (folder / "status.json").write_text("[1, 2]")  # not ours: start over, never crash
    assert decide(folder, "f1").action == "start"


def test_the_lock_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen(
        [
            PY,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]); "
            "from multigpu.queue.lock import RunLock; from pathlib import Path; "
            "lock = RunLock(Path(sys.argv[2]), 'a'); assert lock.acquire(); print('held', flush=True); "
            "time.sleep(60)",
            str(REPO / "src"),
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = RunLock(tmp_path, "a")
        assert not lock.acquire()
        assert lock.holder() == str(holder.pid)
        holder.kill()
        holder.wait()
        assert lock.acquire()
        lock.release()
    finally:
        holder.kill()


def test_two_queues_on_one_out_never_run_a_run_twice(tmp_path):
    """The run waits for a file the test writes after the second queue has answered (sleep_run.py until=):
    the second queue meets it running however long it takes to start, not within a sleep of 4 s."""
    release = tmp_path / "release"
    runs = tmp_path / "runs.yaml"
    runs.write_text(
        f"slow:\n  script: {SLEEP}\n  args: ['0', 'until={release}']\n  out_dir_key: out_dir\n"
    )
    out = tmp_path / "q"
    first = subprocess.Popen(
        [PY, "-m", "multigpu", "queue", str(runs), "--slots", "1", "--out", str(out), "--no-live"],
        env=child_env(),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_files(out / "slow", ["env.json"], timeout=120)  # the run itself has started
        second = multigpu("queue", str(runs), "--slots", "1", "--out", str(out), "--no-live")
        assert second.returncode == 0, second.stdout + second.stderr
        assert "running in another queue" in second.stdout
        release.write_text("")
        stdout, _ = first.communicate(timeout=120)
    finally:
        release.write_text("")
        first.kill()
    assert first.returncode == 0, stdout
    log = (out / "slow" / "log.txt").read_text()
    assert log.count("=== ") == 1  # started once


def test_a_name_that_would_escape_is_refused_before_anything_is_written(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("precious")
    runs = tmp_path / "runs.yaml"
    runs.write_text(f"../victim:\n  script: {SLEEP}\n  args: ['0']\n  out_dir_key: out_dir\n")
    out = tmp_path / "q"
    proc = multigpu("queue", str(runs), "--slots", "1", "--out", str(out), "--no-live")
    assert proc.returncode == 2 and "is not allowed" in proc.stderr
    assert not out.exists() and (victim / "data.txt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("victim")] == ["victim"]


def test_markup_in_notes_and_metrics_is_shown_as_text(tmp_path):
    """A run name with rich markup (a[/]) used to crash the live table; names are now refused, and every
    other string shown (notes, metric values read from the run's folder) is plain text."""
    spec = QueueEntry(name="net", script="t.py")
    folder = tmp_path / "net"
    folder.mkdir()
    (folder / "metrics.csv").write_text("epoch,valid_[/]bold\n1,[/]oops[red]\n")
    (folder / "final.json").write_text("[1, 2]")  # not a mapping: ignored, not a crash
    run = EntryState(spec, folder, note="moved [/] aside [bold]x")

    class Fake:
        root, on_gpus, runs = Path("q[/]"), False, [run]

    console = Console(record=True, width=200)
    console.print(status_table(Fake()))
    text = console.export_text()
    assert "moved [/] aside [bold]x" in text and "[/]oops[red]" in text and "q[/]" in text


# ------------------------------------------------------------------ Slurm scripts and commands


def test_the_queue_job_script_writes_its_end_state_and_is_valid_bash(tmp_path):
    from multigpu.launch import slurm

    job = slurm.SlurmJob(
        command=("t.py", "a b"),
        run_dir=tmp_path / "r",
        options=slurm.SlurmOptions(),
        env=(("A", "x y"),),
        status_file=tmp_path / "r" / "status.json",
        fingerprint="ab12",
    )
    text = slurm.render(job)
    assert "|| code=$?" in text and '"fingerprint": \\"ab12\\"' not in text
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # run the trailer alone with a failing srun: it must write a parseable status
    trailer = re.sub(
        r"(?m)^srun .* \|\| code=\$\?$", "false || code=$?", text[text.index("code=0") :]
    )
    assert "false || code=$?" in trailer
    runner = tmp_path / "trailer.sh"
    runner.write_text("SLURM_JOB_ID=42\n" + trailer)
    (tmp_path / "r").mkdir()
    done = subprocess.run(["bash", str(runner)])
    assert done.returncode == 1
    status = json.loads((tmp_path / "r" / "status.json").read_text())
    assert status == {"state": "failed", "exit_code": 1, "job_id": "42", "fingerprint": "ab12"}


def _fake_scontrol(tmp_path: Path, stderr: str, code: int) -> dict:
    """A fake scontrol, and a sacct that answers as on a cluster without job accounting (scontrol is then asked)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text, exit_code in (
        ("scontrol", stderr, code),
        ("sacct", "Slurm accounting storage is disabled", 1),
    ):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\necho '{text}' >&2\nexit {exit_code}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_slurm_status_tells_an_unreachable_controller_from_an_unknown_job(tmp_path):
    env = _fake_scontrol(
        tmp_path, "slurm_load_jobs error: Unable to contact slurm controller (connect failure)", 1
    )
    proc = multigpu("slurm", "status", "123", env=env)
    assert proc.returncode == 2 and "cannot reach the Slurm controller" in proc.stderr
    (tmp_path / "bin" / "scontrol").write_text(
        "#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n"
    )
    proc = multigpu("slurm", "status", "123", env=env)
    assert proc.returncode == 2 and "Slurm knows no job 123" in proc.stderr


def _requeue_with_fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str):
    """requeue_slurm_job (this process) with a fake ``scontrol`` first on PATH that runs ``body``."""
    from multigpu.guards.preemption import requeue_slurm_job

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "scontrol"
    tool.write_text(f'#!/bin/sh\n[ "$1 $2" = "requeue 1003" ] || exit 9\n{body}\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return requeue_slurm_job


@pytest.mark.parametrize("signal_name, requeued", [("TERM", True), ("KILL", False)])
def test_a_requeue_outlives_the_sigterm_it_causes_and_a_killed_one_says_so(
    tmp_path, monkeypatch, capsys, signal_name, requeued
):
    """`scontrol requeue` ends every process of the job, scontrol among them: a fake scontrol that gets that
    SIGTERM (it signals itself) must still answer, and one killed all the same (srun kills its step) is not a
    failed requeue with an empty reason but one line naming the signal. The line that announces the requeue
    comes first, on stdout: after the request, this process may be killed before it writes anything."""
    requeue = _requeue_with_fake_scontrol(tmp_path, monkeypatch, f"kill -{signal_name} $$\nexit 0")
    assert requeue("1003", signal.SIGUSR1) is requeued
    out, err = capsys.readouterr()
    assert out == "multigpu: requeueing Slurm job 1003 (this ends the job's processes now)\n"
    if requeued:
        assert err == ""
    else:
        assert (
            err.count("\n") == 1
            and "scontrol requeue 1003 was ended by SIGKILL before it answered" in err
        )
        assert "HINT: `scontrol show job 1003`" in err


def test_a_requeue_never_hands_a_forged_job_id_to_scontrol_and_prints_its_refusal_safely(
    tmp_path, monkeypatch, capsys
):
    requeue = _requeue_with_fake_scontrol(
        tmp_path,
        monkeypatch,
        "printf 'scontrol: error: a\\nscontrol: error: \\033]0;pwned\\007 b\\n' >&2\nexit 1",
    )
    # SLURM_JOB_ID set by hand
    for forged in ("-h", "1003; touch pwned", "1003\x1b[2J", "\u0661", "9" * 200_000):
        assert requeue(forged, signal.SIGUSR1) is False
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "is not a Slurm job number" in err
        assert "\x1b" not in err and len(err) < 300
    # scontrol's own refusal: its lines joined into one, terminal-safe
    assert requeue("1003", signal.SIGUSR1) is False
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "failed: scontrol: error: a scontrol: error: \\x1b]0;pwned\\x07 b (HINT:" in err
    )


def test_slurm_options_are_validated_for_the_queue_too(tmp_path):
    from multigpu.launch.slurm import SlurmOptions

    for options, needle in (
        (SlurmOptions(partition="a\nb"), "--partition"),
        (SlurmOptions(mem="1G;x"), "--mem"),
        (SlurmOptions(extra=("--qos=a b",)), "--sbatch-arg"),
        (SlurmOptions(nodes=0), "--nodes"),
    ):
        with pytest.raises(LaunchError, match=needle):
            options.validate()


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["slurm", "--nodes", "\u0662", "t.py"], "--nodes"),
        (["run", "--nproc", "\u0662", "t.py"], "--nproc"),
        (["run", "--max-restarts", "1_0", "t.py"], "--max-restarts"),
        (["queue", "r.yaml", "--slots", "\u0662"], "--slots"),
        (["run", "--rdzv-conf", "join_timeout=\u0669", "t.py"], "--rdzv-conf"),
    ],
)
def test_whole_number_flags_take_ascii_digits_only(argv, flag, capsys, tmp_path, monkeypatch):
    """int() reads "٢" as 2 and "1_0" as 10 (and "²" passes str.isdigit() but not int()): a flag is
    digits 0-9 or one line with a HINT naming it."""
    from multigpu.cli import main

    monkeypatch.chdir(tmp_path)  # no t.py, no r.yaml: nothing can start
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2 and len(err) == 1 and err[0].startswith("multigpu: error:") and "HINT:" in err[0]
    ), err
    assert flag in err[0], err


def test_validate_whole_number_is_the_one_door():
    from multigpu import validate

    assert validate.whole_number("-12", "X") == -12 and validate.whole_number(7, "X") == 7
    for text in ("\u0661\u0662", "1_000", " 1", "1.0", "", "\u00b2", True):
        with pytest.raises(ConfigError, match="X=.* is not an integer.*HINT"):
            validate.whole_number(text, "X", ConfigError)
    from multigpu.launch.devices import parse_gpu_ids
    from multigpu.launch.rendezvous import parse_nnodes

    for text in ("\u0660,\u0661", "\u00b2", "1-\u00b3"):
        with pytest.raises(LaunchError, match="--gpus.*HINT"):
            parse_gpu_ids(text)
    for text in ("\u0661", "1:\u0662", "1_0"):
        with pytest.raises(LaunchError, match="--nnodes.*HINT"):
            parse_nnodes(text)
    assert (
        not validate.is_digits("\u0661")
        and not validate.is_digits("\u00b2")
        and validate.is_digits("0123")
    )
