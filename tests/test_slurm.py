"""multigpu on a real Slurm cluster: Debian's slurmctld, two slurmd acting as two nodes, a private munged,
job accounting (slurmdbd on a private MariaDB, so sacct answers) and 4 fake GPUs per node.

The fixture installs the packages when they are missing (apt-get, as root) and starts the cluster
under a temporary directory with its own SLURM_CONF; everything it started is gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import PY, REPO, SCRIPTS, child_env

pytestmark = [pytest.mark.infra, pytest.mark.timeout(600)]

if os.geteuid() != 0 or not sys.platform.startswith("linux"):
    pytest.skip(
        "the Slurm cluster needs root on Linux (slurmd starts jobs as any user)",
        allow_module_level=True,
    )

from infra.slurm_cluster import SlurmCluster, ensure_slurm_installed  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ensure_slurm_installed(accounting=True)
    # 16 CPUs per node (more than the machine has: Slurm only counts them) for the CPUs a GPU job asks for.
    # Each cluster's job ids (and so its jobs' rendezvous ports, 15000 + id) are a block of its own on this
    # machine (infra.slurm_cluster.JOB_ID_BLOCK): the Slurm files, and two test runs, may run side by side.
    with SlurmCluster(
        tmp_path_factory.mktemp("slurm"),
        nodes=2,
        cpus_per_node=16,
        verbose=False,
        accounting=True,
        gpus_per_node=4,
    ) as c:
        yield c


def _env(cluster, **extra) -> dict:
    env = child_env()
    env.update(
        {
            k: v
            for k, v in cluster.env.items()
            if k in ("SLURM_CONF", "SLURMLAB_CLUSTER_TAG", "PATH")
        }
    )
    env.update(extra)
    return env


def _multigpu(cluster, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "multigpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(cluster),
        cwd=str(REPO),
    )


def _job_id(stdout: str) -> int:
    return int(stdout.split("submitted job ")[1].split()[0])


def _wait(cluster, job_id, timeout=180) -> dict:
    return cluster.wait_job(job_id, timeout=timeout)


def test_two_node_job_trains_and_checkpoints(cluster, tmp_path):
    out = tmp_path / "out"
    proc = _multigpu(
        cluster,
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "0",
        "--time",
        "10:00",
        "--run-dir",
        str(tmp_path / "job"),
        "examples/digits/train.py",
        "examples/digits/hparams.yaml",
        "trainer.epochs=4",
        f"trainer.out_dir={out}",
        f"data.folder={tmp_path / 'data'}",
    )
    assert proc.returncode == 0, proc.stderr
    job_id = _job_id(proc.stdout)
    info = _wait(cluster, job_id)
    log = (tmp_path / "job" / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    assert info["NodeList"] == "n[1-2]"
    # the master address came from NodeAddr, not the node name
    assert "rendezvous 127.0.0.1:" in log
    assert "x 2 process(es)" in log and "final validation accuracy" in log
    assert list((out / "checkpoints").glob("step-*"))
    assert json.loads((out / "final.json").read_text())["accuracy"] > 0.9
    status = _multigpu(cluster, "slurm", "status", str(job_id))
    assert f"job {job_id}" in status.stdout and "COMPLETED" in status.stdout
    logs = _multigpu(cluster, "slurm", "logs", str(job_id))
    assert "final validation accuracy" in logs.stdout


def test_srun_python_train_py_reads_the_slurm_variables(cluster, tmp_path):
    out = tmp_path / "argv.json"
    proc = subprocess.run(
        [
            "srun",
            "-N2",
            "-n2",
            "--export=ALL,MASTER_ADDR=127.0.0.1",
            PY,
            str(SCRIPTS / "argv_dump.py"),
            str(out),
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(cluster),
        cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and record["source"] == "slurm"


def test_arguments_are_shell_quoted(cluster, tmp_path):
    nasty = "a b; touch pwned"
    proc = _multigpu(
        cluster,
        "slurm",
        "--gpus-per-node",
        "0",
        "--run-dir",
        str(tmp_path / "job"),
        str(SCRIPTS / "argv_dump.py"),
        str(tmp_path / "argv.json"),
        nasty,
        "$(touch pwned2)",
        "'",
    )
    assert proc.returncode == 0, proc.stderr
    info = _wait(cluster, _job_id(proc.stdout))
    assert info["JobState"] == "COMPLETED"
    assert json.loads((tmp_path / "argv.json").read_text())["argv"] == [
        nasty,
        "$(touch pwned2)",
        "'",
    ]
    assert not (REPO / "pwned").exists() and not (REPO / "pwned2").exists()


def test_usr1_checkpoints_requeues_and_the_requeued_job_resumes(cluster, tmp_path):
    # Reference: the same 2-process training, uninterrupted, on this machine.
    reference = tmp_path / "reference"
    local = subprocess.run(
        [PY, "-m", "multigpu", "run", "--nproc", "2", str(SCRIPTS / "faults.py"), str(reference)],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(),
        cwd=str(REPO),
    )
    assert local.returncode == 0, local.stderr
    out = tmp_path / "out"
    proc = _multigpu(
        cluster,
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "0",
        "--run-dir",
        str(tmp_path / "job"),
        str(SCRIPTS / "faults.py"),
        str(out),
        "--sleep",
        "0.3",
    )
    assert proc.returncode == 0, proc.stderr
    job_id = _job_id(proc.stdout)
    deadline = time.monotonic() + 120
    while not list((out / "checkpoints").glob("step-0000000[3-9]")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert time.monotonic() < deadline, "the job never reached step 3"
    signalled = cluster.run(["scancel", "--signal=USR1", str(job_id)])
    assert signalled.returncode == 0
    info = _wait(cluster, job_id, timeout=240)
    log = (tmp_path / "job" / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "1", log
    assert (
        "stopped by SIGUSR1" in log
        and f"requeueing Slurm job {job_id}" in log
        and "requeue failed" not in log
    )
    assert "(restart 1)" in log and "resumed from" in log
    final, expected = (torch.load(p / "final.pt", weights_only=True) for p in (out, reference))
    assert all(torch.equal(final[k], expected[k]) for k in expected)  # the requeue lost nothing


def test_queue_submits_each_run_as_a_job(cluster, tmp_path):
    runs = tmp_path / "runs.yaml"
    runs.write_text(f"""
small:
  script: examples/digits/train.py
  args: [examples/digits/hparams.yaml]
  overrides: {{trainer.epochs: 2, data.folder: {tmp_path / "data"}, model.hidden: 32}}
wider < small:
  overrides: {{model.hidden: 64}}
""")
    proc = _multigpu(
        cluster, "queue", str(runs), "--slurm", "--gpus-per-node", "0", "--out", str(tmp_path / "q")
    )
    assert proc.returncode == 0, proc.stderr
    ids = {
        line.split(":")[0]: int(line.split("submitted job ")[1].split()[0])
        for line in proc.stdout.splitlines()
        if "submitted job" in line
    }
    assert set(ids) == {"small", "wider"}
    for name, job_id in ids.items():
        assert _wait(cluster, job_id)["JobState"] == "COMPLETED"
        assert (tmp_path / "q" / name / "final.json").exists()
        assert (
            "hidden: 64" in (tmp_path / "q" / name / "config.yaml").read_text() or name == "small"
        )


def test_cancel(cluster, tmp_path):
    proc = _multigpu(
        cluster,
        "slurm",
        "--gpus-per-node",
        "0",
        "--run-dir",
        str(tmp_path / "job"),
        str(SCRIPTS / "sleeper.py"),
        str(tmp_path),
        "token",
    )
    job_id = _job_id(proc.stdout)
    cancelled = _multigpu(cluster, "slurm", "cancel", str(job_id))
    assert cancelled.returncode == 0 and f"cancelled job {job_id}" in cancelled.stdout
    assert _wait(cluster, job_id)["JobState"] == "CANCELLED"
    unknown = _multigpu(cluster, "slurm", "status", "999999")
    assert unknown.returncode == 2 and "knows no job 999999" in unknown.stderr


def test_doctor_as_a_two_node_job_reports_and_fails_the_job_on_a_fault(cluster, tmp_path):
    results = {}
    for name, extra in (("healthy", []), ("full", ["--checkpoint-gb", "1e9"])):
        proc = _multigpu(
            cluster,
            "slurm",
            "--nodes",
            "2",
            "--gpus-per-node",
            "0",
            "--time",
            "5:00",
            "--run-dir",
            str(tmp_path / name),
            "-m",
            "multigpu.diagnostics.doctor",
            "--out",
            str(tmp_path / "out"),
            "--sizes",
            "1",
            *extra,
        )
        assert proc.returncode == 0, proc.stderr
        job_id = _job_id(proc.stdout)
        results[name] = (
            _wait(cluster, job_id),
            (tmp_path / name / f"slurm-{job_id}.out").read_text(),
        )
    info, log = results["healthy"]
    assert info["JobState"] == "COMPLETED", log
    assert "2 rank(s) on 2 node(s)" in log and "shared             ok" in log
    info, log = results["full"]
    assert info["JobState"] == "FAILED", log
    assert "multigpu: error: " in log and "the checkpoints need 1e+09 GB" in log


# ------------------------------------------------------------------ GPUs, arrays, status after the end


def _status_until(cluster, job_id, needle, timeout=30) -> str:
    """`multigpu slurm status JOB` once it shows ``needle`` (accounting is written a moment after the end)."""
    deadline = time.monotonic() + timeout
    while True:
        proc = _multigpu(cluster, "slurm", "status", str(job_id))
        if needle in proc.stdout or time.monotonic() > deadline:
            return proc.stdout + proc.stderr
        time.sleep(0.5)


def test_a_gres_job_asks_for_and_sees_its_gpus(cluster, tmp_path):
    out = tmp_path / "out"
    proc = _multigpu(
        cluster,
        "slurm",
        "--sbatch-arg=--gres=gpu:2",
        "--run-dir",
        str(tmp_path / "job"),
        str(SCRIPTS / "slurm_task.py"),
        f"out_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr
    script = (tmp_path / "job" / "job.sbatch").read_text()
    # 4 cores per GPU process
    assert "#SBATCH --gres=gpu:2" in script and "#SBATCH --cpus-per-task=8" in script
    (launcher,) = [line for line in script.splitlines() if line.startswith("srun ")]
    # a process per GPU, never the CPU
    assert "--nproc 2" in launcher and "--cpu" not in launcher.split()
    job_id = _job_id(proc.stdout)
    info = _wait(cluster, job_id)
    log = (tmp_path / "job" / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    assert info["TresPerNode"] == "gres:gpu:2" and info["CPUs/Task"] == "8"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:  # what each worker got: Slurm's two GPUs, one process for each
        assert rank["CUDA_VISIBLE_DEVICES"] == "0,1" and rank["SLURM_GPUS_ON_NODE"] == "2", rank
        assert rank["WORLD_SIZE"] == "2"


def test_an_array_of_4_runs_2_at_a_time_then_the_same_command_resubmits_the_failed_one(
    cluster, tmp_path
):
    runs = tmp_path / "runs.yaml"
    runs.write_text(f"""
r0:
  script: {SCRIPTS / "slurm_task.py"}
  args: [sleep=1]
  out_dir_key: out_dir
r1 < r0: {{}}
r2 < r0:
  overrides: {{fail_once: 1}}
r3 < r0: {{}}
""")
    command = (
        "queue",
        str(runs),
        "--slurm",
        "--array",
        "--max-parallel",
        "2",
        "--gpus-per-node",
        "0",
        "--out",
        str(tmp_path / "q"),
    )
    proc = _multigpu(cluster, *command)
    assert proc.returncode == 0, proc.stderr
    array_id = int(proc.stdout.split("submitted array job ")[1].split()[0])
    assert "4 task(s), 2 at a time" in proc.stdout
    (script,) = (tmp_path / "q" / ".slurm").glob("array-*/job.sbatch")
    assert "#SBATCH --array=0,1,2,3%2" in script.read_text()
    states = {i: _wait(cluster, f"{array_id}_{i}")["JobState"] for i in range(4)}
    assert states == {0: "COMPLETED", 1: "COMPLETED", 2: "FAILED", 3: "COMPLETED"}
    spans = []
    for i in range(4):
        folder = tmp_path / "q" / f"r{i}"
        status = json.loads((folder / "status.json").read_text())
        assert (
            status["state"] == ("failed" if i == 2 else "done")
            and status["job_id"] == f"{array_id}_{i}"
        )
        # each task logs into its own run folder
        assert (folder / f"slurm-{array_id}_{i}.out").exists()
        record = json.loads((folder / "rank0.json").read_text())
        assert record["SLURM_ARRAY_TASK_ID"] == str(i)
        spans.append((record["start"], record["end"]))
    # Slurm's throttle: when any task started, at most one other was running
    assert all(sum(s <= start < e for s, e in spans) <= 2 for start, _ in spans), spans
    table = _multigpu(
        cluster, "queue", str(runs), "--slurm", "--status", "--out", str(tmp_path / "q")
    )
    assert table.returncode == 0, table.stderr
    assert (
        table.stdout.count(" done ") == 3
        and " failed " in table.stdout
        and f"{array_id}_2" in table.stdout
    )

    again = _multigpu(cluster, *command)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("skipped - finished earlier") == 3
    second = int(again.stdout.split("submitted array job ")[1].split()[0])
    assert "1 task(s)" in again.stdout and f"r2: submitted job {second}_2" in again.stdout
    assert _wait(cluster, f"{second}_2")["JobState"] == "COMPLETED"
    assert json.loads((tmp_path / "q" / "r2" / "status.json").read_text())["state"] == "done"


def test_status_reports_a_failed_and_a_requeued_job_after_they_end(cluster, tmp_path):
    failing = _multigpu(
        cluster,
        "slurm",
        "--gpus-per-node",
        "0",
        "--run-dir",
        str(tmp_path / "failing"),
        str(SCRIPTS / "slurm_task.py"),
        f"out_dir={tmp_path / 'f'}",
        "fail=3",
    )
    out = tmp_path / "out"
    requeued = _multigpu(
        cluster,
        "slurm",
        "--gpus-per-node",
        "0",
        "--run-dir",
        str(tmp_path / "requeued"),
        str(SCRIPTS / "faults.py"),
        str(out),
        "--sleep",
        "0.3",
        "--epochs",
        "1",
    )
    assert failing.returncode == 0 and requeued.returncode == 0, failing.stderr + requeued.stderr
    failed_id, requeued_id = _job_id(failing.stdout), _job_id(requeued.stdout)
    deadline = time.monotonic() + 120
    while not list((out / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.run(["scancel", "--signal=USR1", str(requeued_id)]).returncode == 0
    assert _wait(cluster, failed_id)["JobState"] == "FAILED"
    assert _wait(cluster, requeued_id, timeout=240)["JobState"] == "COMPLETED"

    shown = _status_until(cluster, failed_id, "[sacct]")
    assert (
        f"job {failed_id} (slur-" in shown and "FAILED, exit " in shown and "exit 0:0" not in shown
    ), shown
    assert f"log {tmp_path / 'failing'}/slurm-{failed_id}.out [sacct]" in shown, shown
    shown = _status_until(cluster, requeued_id, "restarts 1")
    assert "COMPLETED, exit 0:0" in shown and "restarts 1" in shown and "[sacct]" in shown, shown
    listed = _multigpu(cluster, "slurm", "status")
    assert listed.returncode == 0 and "(sacct, submitted in the last 7 day(s))" in listed.stdout, (
        listed.stderr
    )
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[2:]}
    assert "FAILED" in rows[str(failed_id)] and "COMPLETED" in rows[str(requeued_id)], listed.stdout
    logs = _multigpu(cluster, "slurm", "logs", str(failed_id))
    assert "this task fails on purpose" in logs.stdout, logs.stdout + logs.stderr


def test_without_accounting_status_comes_from_scontrol(tmp_path_factory, tmp_path):
    with SlurmCluster(tmp_path_factory.mktemp("slurm-noacct"), nodes=1, verbose=False) as plain:
        proc = _multigpu(
            plain,
            "slurm",
            "--gpus-per-node",
            "0",
            "--run-dir",
            str(tmp_path / "job"),
            str(SCRIPTS / "slurm_task.py"),
            f"out_dir={tmp_path / 'out'}",
        )
        assert proc.returncode == 0, proc.stderr
        job_id = _job_id(proc.stdout)
        assert plain.wait_job(job_id, timeout=120)["JobState"] == "COMPLETED"
        shown = _multigpu(plain, "slurm", "status", str(job_id))
        assert "COMPLETED, exit 0:0" in shown.stdout and shown.stdout.rstrip().endswith(
            "[scontrol]"
        ), shown.stdout
        listed = _multigpu(plain, "slurm", "status")
        assert (
            "scontrol: this cluster keeps no job accounting" in listed.stdout
            and str(job_id) in listed.stdout
        )
