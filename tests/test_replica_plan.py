"""Replica groups without starting a job: the world's variables, the settings, the strategy rules, the
launcher's flags and status, the Trainer's finished marker, and the Slurm script (rendered and its
per-node line run with stubs). The jobs themselves are in test_replica_groups.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import PY, child_env

from multigpu.distributed.world import World, detect_world
from multigpu.errors import ConfigError, LaunchError, WorldError
from multigpu.launch import replicas
from multigpu.launch.flags import RunFlags
from multigpu.launch.interpreter import python_module

FT_ENV = {
    "RANK": "0",
    "WORLD_SIZE": "1",
    "MASTER_PORT": "29500",
    "REPLICA_GROUP_ID": "1",
    "NUM_REPLICA_GROUPS": "3",
    "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510",
    "MULTIGPU_MIN_REPLICAS": "2",
}


# ------------------------------------------------------------------------------------------ the world
def test_the_world_reads_the_replica_group_variables():
    world = detect_world(FT_ENV)
    assert (world.replica_group, world.replica_groups, world.min_replicas) == (1, 3, 2)
    assert world.lighthouse == "http://127.0.0.1:29510" and world.global_rank == 1
    assert "replica group 1/3" in world.describe()
    plain = detect_world({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"})
    assert (plain.replica_group, plain.replica_groups, plain.lighthouse, plain.global_rank) == (
        0,
        1,
        None,
        1,
    )


@pytest.mark.parametrize(
    "change, expect",
    [
        ({"TORCHFT_LIGHTHOUSE": ""}, "are set but TORCHFT_LIGHTHOUSE is not"),
        ({"TORCHFT_LIGHTHOUSE": "127.0.0.1:1"}, "is not http://HOST:PORT"),
        ({"TORCHFT_LIGHTHOUSE": "http://a b:1"}, "is not http://HOST:PORT"),
        ({"REPLICA_GROUP_ID": "3"}, "replica group 3 of 3"),
        ({"NUM_REPLICA_GROUPS": "0"}, "replica group 1 of 0"),
        ({"MULTIGPU_MIN_REPLICAS": "4"}, "with 4 needed per step"),
        ({"REPLICA_GROUP_ID": "x"}, "REPLICA_GROUP_ID='x' is not an integer"),
    ],
)
def test_bad_replica_group_variables_are_one_line(change, expect):
    with pytest.raises(WorldError, match=expect.replace("(", r"\(")):
        detect_world({**FT_ENV, **change})


# ------------------------------------------------------------------------------------------ settings
def test_fault_tolerance_setting_is_checked_and_defaults_min_replicas():
    from multigpu.trainer.settings import TrainerSettings

    assert TrainerSettings(fault_tolerance={"replica_groups": 2}).fault_tolerance == {
        "replica_groups": 2,
        "min_replicas": 1,
    }
    for bad, expect in [
        ([2], "is invalid"),
        ({"min_replicas": 1}, "is invalid"),
        ({"replica_groups": 2, "x": 1}, "has no setting"),
        ({"replica_groups": 0}, "replica_groups=0"),
        ({"replica_groups": True}, "replica_groups=True"),
        ({"replica_groups": 2, "min_replicas": 3}, "more than replica_groups"),
    ]:
        with pytest.raises(ConfigError, match=expect):
            TrainerSettings(fault_tolerance=bad)


def test_the_setting_must_match_the_launch():
    from multigpu.distributed.parallel import check_replica_groups as require_launch

    require_launch(None, World())
    require_launch({"replica_groups": 3, "min_replicas": 2}, detect_world(FT_ENV))
    with pytest.raises(ConfigError, match="was not launched with replica groups"):
        require_launch({"replica_groups": 2, "min_replicas": 1}, World())
    with pytest.raises(ConfigError, match="launched with 3, at least 2"):
        require_launch({"replica_groups": 2, "min_replicas": 1}, detect_world(FT_ENV))


# ------------------------------------------------------------------------------------------ strategies
def test_auto_and_ddp_mean_ft_ddp_in_replica_groups_and_others_are_refused():
    import torch

    from multigpu.strategies import make_strategy, resolve_name

    world = detect_world(FT_ENV)
    assert resolve_name("auto", world) == resolve_name("ddp", world) == "ft-ddp"
    assert resolve_name("auto", World(world_size=2, local_world_size=2)) == "ddp"
    with pytest.raises(ConfigError, match="cannot run in replica groups"):
        make_strategy("fsdp", world, [torch.device("cpu")])
    with pytest.raises(ConfigError, match="needs replica groups"):
        make_strategy("ft-ddp", World(), [torch.device("cpu")])
    with pytest.raises(ConfigError, match="timeout_s"):
        make_strategy("ft-ddp", world, [torch.device("cpu")], timeout_s=0)


def test_a_missing_torchft_is_one_line_with_a_hint(monkeypatch):
    from multigpu.strategies.fault_tolerant import import_torchft

    # what `import torchft` sees when it is not installed
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ConfigError) as caught:
        import_torchft()
    assert "pip install 'multigpu[ft]'" in caught.value.one_line()


# ------------------------------------------------------------------------------------------ the launcher
def test_replica_settings_and_addresses_are_checked():
    assert replicas.ReplicaSettings(2, 2, 0.5).check().groups == 2
    for groups, least, beat, expect in [
        (0, 1, 5, "--replica-groups 0"),
        (2, 3, 5, "--min-replicas 3"),
        (2, 0, 5, "--min-replicas 0"),
        (2, 1, 0, "--heartbeat-timeout 0"),
        (2, 1, float("nan"), "--heartbeat-timeout nan"),
        (5000, 1, 5, "5000"),
    ]:
        with pytest.raises(LaunchError, match=expect):
            replicas.ReplicaSettings(groups, least, beat).check()
    assert replicas.parse_address("node1:29510") == ("node1", 29510)
    assert replicas.parse_address("[::1]:29510") == ("[::1]", 29510)
    for bad in ("node1", "node1:0", "node1:70000", "a b:1", "h;rm:1", ":1"):
        with pytest.raises(LaunchError, match="is not HOST:PORT"):
            replicas.parse_address(bad)


def test_group_environment_and_command_line():
    env = replicas.group_env(
        1, replicas.ReplicaSettings(2, 1), "127.0.0.1:4000", loopback=True, verbose=False, threads=1
    )
    assert env["REPLICA_GROUP_ID"] == "1" and env["NUM_REPLICA_GROUPS"] == "2"
    assert (
        env["TORCHFT_LIGHTHOUSE"] == "http://127.0.0.1:4000" and env["MULTIGPU_MIN_REPLICAS"] == "1"
    )
    argv = RunFlags(
        nproc=1,
        cpu=True,
        local_addr="127.0.0.1",
        replica_groups=2,
        replica_group=1,
        min_replicas=1,
        lighthouse="127.0.0.1:4000",
        heartbeat_timeout=5.0,
    ).to_argv(["train.py", "--lr", "1"], python="py")
    assert argv == [
        *python_module("multigpu", "py"),
        "run",
        "--nproc",
        "1",
        "--replica-groups",
        "2",
        "--replica-group",
        "1",
        "--lighthouse",
        "127.0.0.1:4000",
        "--local-addr",
        "127.0.0.1",
        "--cpu",
        "--",
        "train.py",
        "--lr",
        "1",
    ]


@pytest.mark.parametrize(
    "codes, received, status",
    [
        ({0: 0, 1: 0}, [], 0),
        ({0: 0, 1: 1}, [], 0),
        ({0: 1, 1: 137}, [], 1),
        ({0: 75, 1: 75}, [signal.SIGTERM], 75),
        ({0: 130, 1: 130}, [signal.SIGINT], 130),
        ({0: 75, 1: 143}, [signal.SIGTERM], 143),
    ],
)
def test_the_launchers_status(codes, received, status):
    said: list[str] = []
    assert replicas._status(codes, received, said.append) == status


def test_an_agent_dies_with_the_replica_launcher(tmp_path):
    """The replica launcher hosts the lighthouse: when it dies (even by SIGKILL) its agents must too."""
    child = tmp_path / "child.pid"
    middle = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from multigpu.distributed.job import job_env
        code = "from multigpu.launch.replicas import follow_launcher; follow_launcher(); import time; time.sleep(60)"
        env = {{**os.environ, **job_env(None, replica_launcher_pid=os.getpid())}}
        proc = subprocess.Popen([sys.executable, "-c", code], env=env)
        open({str(child)!r}, "w").write(str(proc.pid))
        time.sleep(60)
    """)
    launcher = subprocess.Popen([PY, "-c", middle], env=child_env())
    try:
        for _ in range(200):
            if child.exists() and child.read_text():
                break
            subprocess.run(["sleep", "0.05"])
        pid = int(child.read_text())
        subprocess.run(["sleep", "0.5"])  # the child's prctl happens right after it starts
        launcher.kill()
        launcher.wait()
        for _ in range(100):
            if (
                not Path(f"/proc/{pid}").exists()
                or Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
            ):
                break
            subprocess.run(["sleep", "0.05"])
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the agent outlived the replica launcher")
    finally:
        launcher.kill()


# ------------------------------------------------------------------------------------------ the Trainer's side
def test_a_group_alone_behind_a_finished_job_stops(tmp_path):
    from multigpu.trainer.replicas import FINISHED_FILE, FinishedElsewhere, ReplicaGroups

    said: list[str] = []
    helper = ReplicaGroups.__new__(ReplicaGroups)  # only the marker logic: no Trainer, no torchft
    helper.root, helper.group, helper.trainer = (
        tmp_path,
        1,
        SimpleNamespace(run=SimpleNamespace(print=said.append)),
    )
    helper._stop_if_finished_elsewhere(10)  # no marker: go on
    (tmp_path / FINISHED_FILE).write_text(json.dumps({"step": 47, "group": 0}))
    # a rerun of a finished job with more epochs starts there: go on
    helper._stop_if_finished_elsewhere(47)
    with pytest.raises(FinishedElsewhere) as stopped:
        helper._stop_if_finished_elsewhere(12)
    assert stopped.value.code == 0 and "finished at step 47" in said[-1]
    (tmp_path / FINISHED_FILE).write_text("[not json")
    helper._stop_if_finished_elsewhere(12)  # an unreadable marker is no marker


# ------------------------------------------------------------------------------------------ Slurm
def _job(tmp_path: Path, python: str = "/usr/bin/python3", **options: object):
    from multigpu.launch import slurm

    return slurm.SlurmJob(
        command=("train.py", "--lr", "3e-4"),
        run_dir=tmp_path / "run",
        options=slurm.SlurmOptions(
            **{"nodes": 2, "gpus_per_node": 0, "replica_groups": 2, "max_restarts": 2, **options}
        ),
        workdir=tmp_path,
        python=python,
    )


def test_the_slurm_script_starts_the_lighthouse_on_the_first_node_and_one_group_per_node(tmp_path):
    from multigpu.launch import slurm

    text = slurm.render(_job(tmp_path))
    lines = text.splitlines()
    lighthouse = next(
        i for i, line in enumerate(lines) if "multigpu.launch.replicas" in line and "--bind" in line
    )
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    # the batch script - which Slurm runs on the first node - hosts it, before the groups
    assert lighthouse < srun
    assert '--bind "$MASTER_ADDR:$LIGHTHOUSE_PORT" --replica-groups 2' in lines[lighthouse]
    assert lines[lighthouse].endswith("&") and 'trap \'kill "$lighthouse"' in text
    assert (
        "--kill-on-bad-exit=0" in lines[srun] and '--replica-group "$SLURM_NODEID"' in lines[srun]
    )
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    with pytest.raises(LaunchError, match="each node runs one replica group"):
        slurm.render(_job(tmp_path, nodes=3))


def test_the_slurm_line_gives_each_node_its_group_before_the_script(tmp_path):
    """The srun line, run by bash with srun and scontrol stubbed: node 1 runs `multigpu run` with its group
    number and the lighthouse, the flags before the script and the script's own arguments untouched."""
    from multigpu.launch import slurm

    stub = tmp_path / "python-stub"
    stub.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    stub.chmod(0o755)
    srun = next(
        line
        for line in slurm.render(_job(tmp_path, python=str(stub))).splitlines()
        if line.startswith("srun ")
    )
    shell = (
        'srun() { shift; "$@"; }; scontrol() { echo "NodeName=n2 NodeAddr=10.9.9.2 State=IDLE"; }; '
        f"export -f scontrol; {srun}"
    )
    done = subprocess.run(
        ["bash", "-c", shell],
        capture_output=True,
        text=True,
        timeout=30,
        env={
            "PATH": os.environ["PATH"],
            "SLURM_NODEID": "1",
            "SLURMD_NODENAME": "n2",
            "MASTER_ADDR": "10.9.9.1",
            "LIGHTHOUSE_PORT": "35007",
        },
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        *python_module("multigpu", str(stub))[1:],
        "run",
        "--replica-group",
        "1",
        "--local-addr",
        "10.9.9.2",
        "--nproc",
        "1",
        "--max-restarts",
        "2",
        "--replica-groups",
        "2",
        "--lighthouse",
        "10.9.9.1:35007",
        "--cpu",
        # RunFlags' line: --min-replicas 1 and --heartbeat-timeout 5 are the defaults
        "--",
        "train.py",
        "--lr",
        "3e-4",
    ]
