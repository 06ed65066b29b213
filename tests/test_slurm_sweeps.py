"""A search on a real Slurm cluster (Debian's slurmctld and one slurmd, see tests/infra/slurm_cluster.py):
its trials run as array tasks, 2 at a time, from a queue that follows them, prunes them through their
reports on the shared file system and tells the study; the same command again skips every trial."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import PY, REPO, SCRIPTS, child_env

pytestmark = [pytest.mark.infra, pytest.mark.timeout(600)]

if os.geteuid() != 0 or not sys.platform.startswith("linux"):
    pytest.skip(
        "the Slurm cluster needs root on Linux (slurmd starts jobs as any user)",
        allow_module_level=True,
    )
pytest.importorskip("optuna")

from infra.slurm_cluster import SlurmCluster, ensure_slurm_installed  # noqa: E402


def _multigpu(cluster, *args, timeout=400) -> subprocess.CompletedProcess:
    env = child_env()
    env.update(
        {
            k: v
            for k, v in cluster.env.items()
            if k in ("SLURM_CONF", "SLURMLAB_CLUSTER_TAG", "PATH")
        }
    )
    return subprocess.run(
        [PY, "-m", "multigpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(REPO),
    )


def test_a_search_runs_its_trials_as_array_tasks_followed_by_its_queue(tmp_path_factory, tmp_path):
    ensure_slurm_installed()
    runs = tmp_path / "runs.yaml"
    runs.write_text(f"""
base:
  script: {SCRIPTS / "trial_run.py"}
  out_dir_key: out_dir
  overrides: {{steps: 3}}
s < base:
  sweep:
    params: {{x: {{uniform: [0.0, 1.0]}}}}
  search: {{sampler: random, trials: 3, seed: 21, metric: valid_loss, mode: min, pruner: median, min_trials: 1}}
""")
    out = tmp_path / "q"
    command = (
        "queue",
        str(runs),
        "--only",
        "s",
        "--slurm",
        "--max-parallel",
        "2",
        "--gpus-per-node",
        "0",
        "--time",
        "10:00",
        "--out",
        str(out),
    )
    with SlurmCluster(
        tmp_path_factory.mktemp("slurm-sweep"), nodes=1, cpus_per_node=16, verbose=False
    ) as cluster:
        proc = _multigpu(cluster, *command)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("submitted array job ") == 2  # 2 trials at once, then the third
        assert "(q): 2 task(s)" in proc.stdout and "(q): 1 task(s)" in proc.stdout
        record = json.loads((out / ".sweeps" / "s.json").read_text())
        assert len(record["trials"]) == 3 and "best of s: x=" in proc.stdout
        for trial in record["trials"]:
            folder = out / trial["run"]
            status = json.loads((folder / "status.json").read_text())
            # an array task, ended as done
            assert status["state"] == "done" and "_" in status["job_id"]
            done = json.loads((folder / "done.json").read_text())
            assert done["pruned"] == (trial["state"] == "pruned") and done["last_step"] == (
                1 if done["pruned"] else 3
            )
        # seed 21 draws x = 0.049, 0.289 (good), then 0.721 (bad): asked only once a good trial finished, the
        # third is pruned at its first report - read from its folder on the shared file system, answered there.
        assert {t["run"].split("-")[1]: t["state"] for t in record["trials"]} == {
            "t0": "done",
            "t1": "done",
            "t2": "pruned",
        }
        again = _multigpu(cluster, *command)
        assert again.returncode == 0 and "submitted" not in again.stdout, (
            again.stdout + again.stderr
        )
