"""What `multigpu slurm` and `queue --slurm` write and read, without a cluster (tests/test_slurm.py runs them on one).

- the GPUs of a job from every way Slurm takes them, and the processes and CPUs that follow;
- job names that differ within squeue's 8 columns;
- an array job's script, run with stand-ins for srun and scontrol: each task writes into its own folder;
- sacct and scontrol output as recorded from Slurm 22.05 (Debian 12) on the test cluster, parsed.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from multigpu.errors import LaunchError
from multigpu.launch import slurm, slurm_state
from multigpu.launch.slurm import SlurmArray, SlurmJob, SlurmOptions


def _script(options: SlurmOptions, tmp_path: Path) -> tuple[list[str], str]:
    text = slurm.render(SlurmJob(command=("t.py",), run_dir=tmp_path / "r", options=options))
    sbatch = [line[len("#SBATCH ") :] for line in text.splitlines() if line.startswith("#SBATCH ")]
    (launcher,) = [line for line in text.splitlines() if line.startswith("srun ")]
    return sbatch, launcher


@pytest.mark.parametrize(
    "options, line, processes",
    [
        (SlurmOptions(gpus_per_node=4), "--gpus-per-node=4", 4),
        (SlurmOptions(gpus_per_node=4, gpu_type="a100"), "--gpus-per-node=a100:4", 4),
        (SlurmOptions(gres="gpu:a100:2"), "--gres=gpu:a100:2", 2),
        (SlurmOptions(extra=("--gres=gpu:4",)), "--gres=gpu:4", 4),
        (SlurmOptions(extra=("--gres=gpu",)), "--gres=gpu", 1),
        (SlurmOptions(extra=("--gres=nic:1,gpu:h100:3",)), "--gres=nic:1,gpu:h100:3", 3),
        (SlurmOptions(nodes=2, extra=("--gpus=8",)), "--gpus=8", 4),
        (SlurmOptions(nodes=2, extra=("--gpus=a100:8",)), "--gpus=a100:8", 4),
        (SlurmOptions(extra=("--gpus-per-task=2",)), "--gpus-per-task=2", 2),
        (SlurmOptions(extra=("--gpus-per-node=h100:8",)), "--gpus-per-node=h100:8", 8),
    ],
)
def test_every_way_of_asking_for_gpus_starts_a_process_per_gpu(tmp_path, options, line, processes):
    sbatch, launcher = _script(options, tmp_path)
    assert line in sbatch and sum(s.startswith(("--gpu", "--gres")) for s in sbatch) == 1
    assert f"--nproc {processes}" in launcher and "--cpu" not in launcher.split()
    assert f"--cpus-per-task={processes * slurm.CPUS_PER_GPU_PROCESS}" in sbatch


def test_no_gpus_is_a_cpu_job_with_a_core_per_process(tmp_path):
    sbatch, launcher = _script(SlurmOptions(gpus_per_node=0, nproc_per_node=3), tmp_path)
    assert "--cpu" in launcher.split() and "--nproc 3" in launcher and "--cpus-per-task=3" in sbatch
    assert not any(s.startswith(("--gpu", "--gres")) for s in sbatch)


def test_cpus_per_task_is_overridable_and_not_doubled(tmp_path):
    sbatch, _ = _script(SlurmOptions(gpus_per_node=4, cpus_per_task=32), tmp_path)
    assert "--cpus-per-task=32" in sbatch
    sbatch, _ = _script(SlurmOptions(gpus_per_node=4, extra=("--cpus-per-gpu=6",)), tmp_path)
    assert not any(s.startswith("--cpus-per-task") for s in sbatch) and "--cpus-per-gpu=6" in sbatch


def test_new_job_flags_reach_the_script(tmp_path):
    sbatch, _ = _script(
        SlurmOptions(
            gpus_per_node=0,
            qos="high",
            constraint="a100|h100",
            account="proj",
            mem="64G",
            job_name="sweep",
        ),
        tmp_path,
    )
    for line in (
        "--qos=high",
        "--constraint=a100|h100",
        "--account=proj",
        "--mem=64G",
        "--job-name=sweep",
    ):
        assert line in sbatch


@pytest.mark.parametrize(
    "options, needle",
    [
        (SlurmOptions(gpus_per_node=4, extra=("--gres=gpu:4",)), "asked for twice"),
        (SlurmOptions(gres="gpu:2", extra=("--gpus-per-task=2",)), "asked for twice"),
        (SlurmOptions(nodes=3, extra=("--gpus=8",)), "cannot share evenly"),
        (SlurmOptions(extra=("--gres=gpu:1,gpu:2",)), "names gpu twice"),
        (SlurmOptions(extra=("--gpus-per-socket=2",)), "sets --gpus-per-socket"),
        (SlurmOptions(extra=("--nodes=2",)), "sets --nodes"),
        (SlurmOptions(extra=("--array=0-3",)), "sets --array"),
        (SlurmOptions(mem="8G", extra=("--mem=9G",)), "both as a flag"),
        (SlurmOptions(extra=("--exclusive", "--exclusive")), "twice"),
    ],
)
def test_contradictions_are_one_line(options, needle):
    with pytest.raises(LaunchError, match=needle):
        options.validate()


def test_job_names_fit_squeue_and_differ():
    names = {slurm.timed_job_name("train", 1_800_000_000 + second) for second in range(36**3)}
    assert len(names) == 36**3 and all(len(n) == 8 and n.startswith("trai-") for n in names)
    runs = ["net", "model_small_lr1", "model_small_lr2", "model_small_lr3", "exactly8"]
    short = slurm.short_names(runs)
    assert short["net"] == "net" and short["exactly8"] == "exactly8"
    assert len(set(short.values())) == len(runs) and all(len(n) <= 8 for n in short.values())
    assert slurm.short_names(runs) == short  # the same names each time the runs file is submitted


def test_two_submissions_in_one_second_get_their_own_folder_and_name(tmp_path, monkeypatch):
    from multigpu.commands.slurm import _new_run_dir

    monkeypatch.chdir(tmp_path)
    first, second = _new_run_dir("train", 1_800_000_000), _new_run_dir("train", 1_800_000_000)
    assert (
        first[1] != second[1] and first[0] != second[0] and first[1].is_dir() and second[1].is_dir()
    )


def _stand_ins(tmp_path: Path, srun_exit: int) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", f'echo srun "$@"\nexit {srun_exit}'), ("scontrol", "true")):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\n{body}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_an_array_task_runs_its_own_run_in_its_own_folder(tmp_path):
    tasks = {
        index: SlurmJob(
            command=(f"t{index}.py", "a b"),
            run_dir=tmp_path / f"run{index}",
            env=(("OMP_NUM_THREADS", str(index)),),
            status_file=tmp_path / f"run{index}" / "status.json",
            fingerprint=f"ab{index}",
        )
        for index in (0, 2)
    }
    array = SlurmArray(
        tasks=tasks,
        folder=tmp_path / ".slurm" / "array-1",
        options=SlurmOptions(gpus_per_node=0),
        max_parallel=2,
    )
    script = slurm.write_array(array)
    text = script.read_text()
    assert "#SBATCH --array=0,2%2" in text
    assert json.loads((array.folder / slurm.TASKS_FILE).read_text()) == {
        "0": str(tmp_path / "run0"),
        "2": str(tmp_path / "run2"),
    }
    for index in (0, 2):
        (tmp_path / f"run{index}").mkdir()
    env = {
        **os.environ,
        **_stand_ins(tmp_path, 3),
        "SLURM_JOB_ID": "42",
        "SLURM_ARRAY_JOB_ID": "40",
        "SLURM_ARRAY_TASK_ID": "2",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_NUM_NODES": "1",
    }
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 3, done.stderr
    status = json.loads((tmp_path / "run2" / "status.json").read_text())
    assert status == {"state": "failed", "exit_code": 3, "job_id": "40_2", "fingerprint": "ab2"}
    # the task's output is in its own folder
    log = (tmp_path / "run2" / "slurm-40_2.out").read_text()
    # (the stand-in srun echoes its arguments)
    assert "multigpu: job 42" in log and "--cpu -- t2.py a b" in log
    assert not (tmp_path / "run0" / "status.json").exists()
    env["SLURM_ARRAY_TASK_ID"] = "7"
    stray = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert stray.returncode == 2 and "array task 7 is not one of this script's" in stray.stderr


# Recorded on the test cluster (Slurm 22.05.8, Debian 12, slurmdbd + MariaDB) on 2026-11-24: a job that exits 3,
# one requeued once, an array 0-3%2, one cancelled while running, one pending until --begin=now+3600:
# sacct -X -D --parsable2 --noheader -o JobID,JobIDRaw,JobName,State,Reason,ExitCode,Elapsed,NodeList,Submit,SubmitLine
#       -S 1970-01-01 -E now+30days
SACCT_RECORDED = Path(__file__).parent / "data" / "sacct-22.05.txt"


def test_sacct_rows_become_one_record_per_job_with_its_restarts():
    records = {r.job_id: r for r in slurm_state.parse_sacct(SACCT_RECORDED.read_text())}
    failed = records["1"]
    assert (failed.state, failed.exit_code, failed.restarts) == ("FAILED", "3:0", 0)
    assert failed.script.endswith("/failing/job.sbatch") and failed.log.endswith(
        "/failing/slurm-1.out"
    )
    requeued = records["2"]
    assert (requeued.state, requeued.exit_code, requeued.restarts) == ("COMPLETED", "0:0", 1)
    pending = records["5"]
    assert pending.state == "PENDING" and pending.reason == "BeginTime" and pending.active
    assert "PENDING (BeginTime), submitted " in pending.line()
    tasks = [r for r in records.values() if r.job_id.startswith("3_")]
    # 3 of the 4 tasks: 22.05 leaves task 1's eligible time unset, and a time window (-S/-E) skips it;
    # `sacct -j 3` lists all four, which is why my_jobs asks again by the array's id.
    assert sorted(r.job_id for r in tasks) == ["3_0", "3_2", "3_3"] and all(
        r.state == "COMPLETED" for r in tasks
    )
    assert records["4"].state == "CANCELLED"  # "CANCELLED by 0": the state, without who


def test_a_recorded_scontrol_line_of_an_array_task():
    line = (
        "JobId=7 ArrayJobId=4 ArrayTaskId=2 ArrayTaskThrottle=2 JobName=q UserId=root(0) JobState=FAILED "
        "Reason=NonZeroExitCode Restarts=0 ExitCode=3:0 RunTime=00:00:02 NodeList=n1 SubmitTime=2026-11-24T09:50:26 "
        "Command=/x/q/.slurm/array-1/job.sbatch WorkDir=/x StdOut=/x/q/.slurm/array-1/slurm-4_2.out"
    )
    info = slurm.parse_scontrol(line)
    assert info["ArrayTaskId"] == "2" and info["Command"] == "/x/q/.slurm/array-1/job.sbatch"
    record = slurm_state._record_of_scontrol(info)
    assert record.job_id == "4_2" and record.exit_code == "3:0" and record.source == "scontrol"
    # no task map to read: scontrol's own path
    assert record.log == "/x/q/.slurm/array-1/slurm-4_2.out"


def test_the_queue_table_shows_slurm_while_active_and_the_run_s_end_state_after():
    from multigpu.queue.slurm_jobs import _shown_state

    def record(state, reason=""):
        return slurm_state.JobRecord(
            "9_1", "q", state, reason, "0:0", "00:00:01", "n1", "", 0, "", "", "sacct"
        )

    assert _shown_state({}, []) == ("not submitted", "")
    assert _shown_state({"state": "submitted"}, [record("PENDING", "JobArrayTaskLimit")]) == (
        "pending",
        "JobArrayTaskLimit",
    )
    # requeued, running again
    assert _shown_state({"state": "interrupted"}, [record("RUNNING")]) == ("running", "")
    assert _shown_state({"state": "failed"}, [record("FAILED")]) == ("failed", "")
    state, note = _shown_state({"state": "submitted"}, [record("TIMEOUT")])
    assert state == "timeout" and "run the queue again" in note


# ------------------------------------------------------ hardening: what an #SBATCH line may hold

UNSAFE = ["#", "'", '"', "\\", "$", "`", "\u0085", "\u009b", "\t", "\u2028"]


@pytest.mark.parametrize("char", UNSAFE)
def test_sbatch_arg_values_refuse_characters_sbatch_or_a_shell_would_read(char):
    with pytest.raises(LaunchError) as info:
        SlurmOptions(extra=(f"--mail-user=me{char}x",)).validate()
    line = info.value.one_line()
    assert "--sbatch-arg" in line and "HINT:" in line and "\n" not in line


@pytest.mark.parametrize("char", UNSAFE + ["%", " "])
def test_run_and_array_folders_refuse_characters_sbatch_or_a_shell_would_read(tmp_path, char):
    with pytest.raises(LaunchError, match=r"run folder.*HINT"):
        slurm.render(SlurmJob(command=("t.py",), run_dir=tmp_path / f"r{char}x"))
    task = SlurmJob(
        command=("t.py",), run_dir=tmp_path / "r", status_file=tmp_path / "r" / "status.json"
    )
    with pytest.raises(LaunchError, match=r"array folder.*HINT"):
        slurm.render_array(
            SlurmArray(
                tasks={0: task}, folder=tmp_path / f"a{char}b" / ".slurm", options=SlurmOptions()
            )
        )


@pytest.mark.parametrize("name", ["a$b", "a#b", "a'b", "a`b"])
def test_a_queue_folder_that_becomes_a_job_name_is_checked(tmp_path, name):
    """`queue --slurm` names an array job after its out folder (8 characters): the name lands in #SBATCH.
    (Already refused before the #SBATCH check, by the --job-name pattern; now the run folder is refused first.)"""
    from multigpu.queue.runs import QueueEntry
    from multigpu.queue.slurm_jobs import submit_runs

    with pytest.raises(LaunchError, match="HINT"):
        submit_runs(
            [QueueEntry("net", script="t.py")],
            tmp_path / name,
            SlurmOptions(gpus_per_node=0),
            dry_run=True,
            array=True,
        )
    assert not (tmp_path / name / ".slurm").exists()


def test_the_last_check_covers_every_sbatch_line(tmp_path):
    from multigpu.launch.slurm import _sbatch_lines

    with pytest.raises(LaunchError, match=r"#SBATCH line '--job-name=x\$y'.*HINT"):
        _sbatch_lines(SlurmOptions(), "x$y", tmp_path / "slurm-%j.out")


@pytest.mark.parametrize(
    "arg, needle",
    [
        ("--j=evil", "sets --job-name"),
        ("--ou=/tmp/x", "sets --output"),
        ("--er=/tmp/x", "sets --error"),
        ("--ar=0-3", "sets --array"),
        ("--wr=ls", "sets --wrap"),
        ("--tasks-per=2", "sets --tasks-per-node"),
        ("--ntasks-per-n=2", "sets --ntasks-per-node"),
        ("--gp=2", "ambiguous"),
        ("--gpu=2", "ambiguous"),
        ("--tim=1:00", "ambiguous"),
        ("--mail=END", "ambiguous"),
        ("--exclu", "ambiguous"),
        ("--con=a100", "ambiguous"),
    ],
)
def test_sbatch_arg_abbreviations_are_read_as_sbatch_reads_them(arg, needle):
    with pytest.raises(LaunchError) as info:
        SlurmOptions(extra=(arg,)).validate()
    assert needle in str(info.value) and "HINT:" in str(info.value)


def test_an_ambiguous_prefix_names_the_candidates():
    with pytest.raises(LaunchError, match="--time, --time-min"):
        SlurmOptions(extra=("--tim=1:00",)).validate()


def test_a_unique_prefix_counts_as_its_option(tmp_path):
    assert SlurmOptions(extra=("--gpus-per-n=2",)).gpus == 2  # a GPU request: one process per GPU
    # asks for CPUs itself
    assert SlurmOptions(extra=("--cpus-per-t=8",)).cpus_per_task_planned() is None
    with pytest.raises(LaunchError, match="both as a flag"):
        SlurmOptions(qos="high", extra=("--qo=low",)).validate()
    with pytest.raises(LaunchError, match="both as a flag"):
        SlurmOptions(partition="gpu", extra=("--part=cpu",)).validate()
    with pytest.raises(LaunchError, match="twice"):
        SlurmOptions(extra=("--mail-t=END", "--mail-type=FAIL")).validate()
    sbatch, _ = _script(
        SlurmOptions(gpus_per_node=0, extra=("--mail-t=END", "--mail-user=me@example.org")),
        tmp_path,
    )
    assert "--mail-t=END" in sbatch and "--mail-user=me@example.org" in sbatch


def test_test_clusters_running_at_once_get_job_ids_and_rendezvous_ports_of_their_own(
    tmp_path, monkeypatch
):
    """Two test runs at once each start a local Slurm cluster (tests/infra/slurm_cluster.py): their jobs'
    ids must differ, or two jobs 1003 put their rendezvous on the same port (slurm_port: 15000 + id), as
    happened in a loaded stability run. Each cluster holds a block of ids while it runs (a lock file)."""
    from infra import slurm_cluster
    from infra.slurm_cluster import JOB_ID_BLOCK, SlurmError, _lease_job_ids

    from multigpu.distributed.world import slurm_port

    # not the machine's blocks
    monkeypatch.setattr(slurm_cluster, "JOB_ID_LEASES", tmp_path / "leases")
    first_a, lease_a = _lease_job_ids()
    first_b, lease_b = _lease_job_ids()
    try:
        ports_a = {slurm_port(str(i)) for i in range(first_a, first_a + JOB_ID_BLOCK)}
        ports_b = {slurm_port(str(i)) for i in range(first_b, first_b + JOB_ID_BLOCK)}
        assert len(ports_a) == len(ports_b) == JOB_ID_BLOCK and not ports_a & ports_b
        # below the ports the clusters' daemons pick (20000 and up)
        assert max(ports_a | ports_b) < 20000
    finally:
        os.close(lease_b)
    # the block given back is taken again; the one still held is not
    first_c, lease_c = _lease_job_ids()
    os.close(lease_c)
    os.close(lease_a)
    assert first_c == first_b
    (tmp_path / "leases").chmod(0o777)  # a folder others may write in is refused, in one line
    with pytest.raises(SlurmError, match="remove it"):
        _lease_job_ids()
