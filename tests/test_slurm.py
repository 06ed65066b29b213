"""multigpu on a real Slurm cluster: Debian's slurmctld, two slurmd acting as two nodes, a private munged.

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
    pytest.skip("the Slurm cluster needs root on Linux (slurmd starts jobs as any user)", allow_module_level=True)

from infra.slurm_cluster import SlurmCluster, ensure_slurm_installed  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ensure_slurm_installed()
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus_per_node=2, verbose=False) as c:
        yield c


def _env(cluster, **extra) -> dict:
    env = child_env()
    env.update({k: v for k, v in cluster.env.items() if k in ("SLURM_CONF", "SLURMLAB_CLUSTER_TAG", "PATH")})
    env.update(extra)
    return env


def _multigpu(cluster, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "multigpu", *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(cluster), cwd=str(REPO))


def _job_id(stdout: str) -> int:
    return int(stdout.split("submitted job ")[1].split()[0])


def _wait(cluster, job_id, timeout=180) -> dict:
    return cluster.wait_job(job_id, timeout=timeout)


def test_two_node_job_trains_and_checkpoints(cluster, tmp_path):
    out = tmp_path / "out"
    proc = _multigpu(cluster, "slurm", "--nodes", "2", "--gpus-per-node", "0", "--time", "10:00",
                     "--run-dir", str(tmp_path / "job"), "examples/digits/train.py", "examples/digits/hparams.yaml",
                     "trainer.epochs=4", f"trainer.out_dir={out}", f"data.folder={tmp_path / 'data'}")
    assert proc.returncode == 0, proc.stderr
    job_id = _job_id(proc.stdout)
    info = _wait(cluster, job_id)
    log = (tmp_path / "job" / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    assert info["NodeList"] == "n[1-2]"
    assert "rendezvous 127.0.0.1:" in log  # the master address came from NodeAddr, not the node name
    assert "x 2 process(es)" in log and "final validation accuracy" in log
    assert list((out / "checkpoints").glob("step-*"))
    assert json.loads((out / "final.json").read_text())["accuracy"] > 0.9
    status = _multigpu(cluster, "slurm", "status", str(job_id))
    assert f"job {job_id}" in status.stdout and "COMPLETED" in status.stdout
    logs = _multigpu(cluster, "slurm", "logs", str(job_id))
    assert "final validation accuracy" in logs.stdout


def test_srun_python_train_py_reads_the_slurm_variables(cluster, tmp_path):
    out = tmp_path / "argv.json"
    proc = subprocess.run(["srun", "-N2", "-n2", "--export=ALL,MASTER_ADDR=127.0.0.1", PY,
                           str(SCRIPTS / "argv_dump.py"), str(out), "x"],
                          capture_output=True, text=True, timeout=120, env=_env(cluster), cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and record["source"] == "slurm"


def test_arguments_are_shell_quoted(cluster, tmp_path):
    nasty = "a b; touch pwned"
    proc = _multigpu(cluster, "slurm", "--gpus-per-node", "0", "--run-dir", str(tmp_path / "job"),
                     str(SCRIPTS / "argv_dump.py"), str(tmp_path / "argv.json"), nasty, "$(touch pwned2)", "'")
    assert proc.returncode == 0, proc.stderr
    info = _wait(cluster, _job_id(proc.stdout))
    assert info["JobState"] == "COMPLETED"
    assert json.loads((tmp_path / "argv.json").read_text())["argv"] == [nasty, "$(touch pwned2)", "'"]
    assert not (REPO / "pwned").exists() and not (REPO / "pwned2").exists()


def test_usr1_checkpoints_requeues_and_the_requeued_job_resumes(cluster, tmp_path):
    # Reference: the same 2-process training, uninterrupted, on this machine.
    reference = tmp_path / "reference"
    local = subprocess.run([PY, "-m", "multigpu", "run", "--nproc", "2", str(SCRIPTS / "faults.py"), str(reference)],
                           capture_output=True, text=True, timeout=180, env=child_env(), cwd=str(REPO))
    assert local.returncode == 0, local.stderr
    out = tmp_path / "out"
    proc = _multigpu(cluster, "slurm", "--nodes", "2", "--gpus-per-node", "0", "--run-dir", str(tmp_path / "job"),
                     str(SCRIPTS / "faults.py"), str(out), "--sleep", "0.3")
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
    assert "stopped by SIGUSR1" in log and "requeued Slurm job" in log
    assert "(restart 1)" in log and "resumed from" in log
    final, expected = (torch.load(p / "final.pt", weights_only=True) for p in (out, reference))
    assert all(torch.equal(final[k], expected[k]) for k in expected)  # the requeue lost nothing


def test_queue_submits_each_run_as_a_job(cluster, tmp_path):
    runs = tmp_path / "runs.yaml"
    runs.write_text(f"""
small:
  script: examples/digits/train.py
  args: [examples/digits/hparams.yaml]
  overrides: {{trainer.epochs: 2, data.folder: {tmp_path / 'data'}, model.hidden: 32}}
wider < small:
  overrides: {{model.hidden: 64}}
""")
    proc = _multigpu(cluster, "queue", str(runs), "--slurm", "--gpus-per-node", "0", "--out", str(tmp_path / "q"))
    assert proc.returncode == 0, proc.stderr
    ids = {line.split(":")[0]: int(line.split("submitted job ")[1].split()[0])
           for line in proc.stdout.splitlines() if "submitted job" in line}
    assert set(ids) == {"small", "wider"}
    for name, job_id in ids.items():
        assert _wait(cluster, job_id)["JobState"] == "COMPLETED"
        assert (tmp_path / "q" / name / "final.json").exists()
        assert "hidden: 64" in (tmp_path / "q" / name / "config.yaml").read_text() or name == "small"


def test_cancel(cluster, tmp_path):
    proc = _multigpu(cluster, "slurm", "--gpus-per-node", "0", "--run-dir", str(tmp_path / "job"),
                     str(SCRIPTS / "sleeper.py"), str(tmp_path), "token")
    job_id = _job_id(proc.stdout)
    cancelled = _multigpu(cluster, "slurm", "cancel", str(job_id))
    assert cancelled.returncode == 0 and f"cancelled job {job_id}" in cancelled.stdout
    assert _wait(cluster, job_id)["JobState"] == "CANCELLED"
    unknown = _multigpu(cluster, "slurm", "status", "999999")
    assert unknown.returncode == 2 and "knows no job 999999" in unknown.stderr


def test_doctor_as_a_two_node_job_reports_and_fails_the_job_on_a_fault(cluster, tmp_path):
    results = {}
    for name, extra in (("healthy", []), ("full", ["--checkpoint-gb", "1e9"])):
        proc = _multigpu(cluster, "slurm", "--nodes", "2", "--gpus-per-node", "0", "--time", "5:00",
                         "--run-dir", str(tmp_path / name), "-m", "multigpu.diagnostics.doctor",
                         "--out", str(tmp_path / "out"), "--sizes", "1", *extra)
        assert proc.returncode == 0, proc.stderr
        job_id = _job_id(proc.stdout)
        results[name] = (_wait(cluster, job_id), (tmp_path / name / f"slurm-{job_id}.out").read_text())
    info, log = results["healthy"]
    assert info["JobState"] == "COMPLETED", log
    assert "2 rank(s) on 2 node(s)" in log and "shared             ok" in log
    info, log = results["full"]
    assert info["JobState"] == "FAILED", log
    assert "multigpu: error: " in log and "the checkpoints need 1e+09 GB" in log
