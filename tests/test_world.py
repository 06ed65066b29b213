"""World detection from patched environments: torchrun, Slurm (one node and several), node lists, errors."""

import re

import pytest

from multigpu.distributed.world import (
    World,
    detect_world,
    expand_nodelist,
    expand_tasks_per_node,
    slurm_port,
)
from multigpu.errors import WorldError

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_MAX_RESTARTS": "3",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}

SLURM_TWO_NODES = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NAME": "train",
}


def test_plain_process_is_a_world_of_one():
    world = detect_world({})
    assert world == World()
    assert (world.rank, world.world_size, world.source) == (0, 1, "single")
    assert world.is_main and not world.is_distributed


def test_torchrun_variables():
    world = detect_world(TORCHRUN)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (3, 1, 4, 2)
    assert (world.node_rank, world.num_nodes) == (1, 2)
    assert (world.master_addr, world.master_port) == ("node0", 29500)
    assert world.source == "torchrun"
    assert (world.restart_count, world.max_restarts) == (2, 3)
    assert world.agent_store and not world.is_main and world.is_distributed


def test_torchrun_wins_over_slurm_because_torchrun_runs_inside_slurm_jobs():
    world = detect_world({**SLURM_TWO_NODES, **TORCHRUN})
    assert world.source == "torchrun" and world.rank == 3


def test_plain_rank_variables_need_a_master_port():
    world = detect_world(
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    )
    assert (world.source, world.rank, world.local_rank, world.local_world_size) == ("env", 1, 1, 2)
    with pytest.raises(WorldError, match="MASTER_PORT"):
        detect_world({"RANK": "1", "WORLD_SIZE": "2"})


def test_slurm_two_nodes():
    world = detect_world(SLURM_TWO_NODES)
    assert world.source == "slurm"
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (5, 1, 8, 4)
    assert (world.node_rank, world.num_nodes) == (1, 2)
    assert world.nodes == ("gpu01", "gpu02")
    assert world.master_addr == "gpu01"
    assert world.master_port == slurm_port("123456")
    assert world.launch_id == "123456"


def test_slurm_one_node_and_explicit_master():
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "cpu5",
        "SLURM_TASKS_PER_NODE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "4000",
    }
    world = detect_world(env)
    assert (world.world_size, world.local_world_size, world.num_nodes) == (2, 2, 1)
    assert (world.master_addr, world.master_port) == ("10.0.0.1", 4000)


def test_slurm_uneven_tasks_per_node():
    env = {
        **SLURM_TWO_NODES,
        "SLURM_NTASKS": "5",
        "SLURM_TASKS_PER_NODE": "3,2",
        "SLURM_PROCID": "4",
    }
    assert detect_world(env).local_world_size == 2


def test_slurm_step_variables_win_over_job_variables():
    env = {
        **SLURM_TWO_NODES,
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
    }
    world = detect_world(env)
    assert (world.world_size, world.local_world_size, world.rank) == (2, 1, 1)


@pytest.mark.parametrize(
    "extra",
    [{"SLURM_STEP_ID": None}, {"SLURM_JOB_NAME": "bash"}, {"SLURM_JOB_NAME": "interactive"}],
)
def test_batch_script_and_interactive_shells_are_not_slurm_tasks(extra):
    env = {**SLURM_TWO_NODES, **extra}
    env = {k: v for k, v in env.items() if v is not None}
    assert detect_world(env).source == "single"


def test_slurm_port_is_stable_and_in_range():
    assert slurm_port("123456") == slurm_port("123456")
    assert slurm_port("1") != slurm_port("2")
    for job in ("0", "9999999", "12345_7"):
        assert 15000 <= slurm_port(job) < 35000


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("x[3],y[1-2].lab", ["x3", "y1.lab", "y2.lab"]),
        ("", []),
    ],
)
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu01]", "gpu[a-b]", "gpu[3-1]"])
def test_bad_nodelists_raise_with_a_hint(bad):
    with pytest.raises(WorldError, match="HINT"):
        expand_nodelist(bad)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(WorldError):
        expand_tasks_per_node("2(y3)")


@pytest.mark.parametrize(
    "env, needle",
    [
        ({**TORCHRUN, "RANK": "4"}, "rank 4 is outside world size 4"),
        ({**TORCHRUN, "RANK": "x"}, "RANK='x' is not an integer"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, "local rank 2 is outside local world size 2"),
        (
            {**TORCHRUN, "GROUP_WORLD_SIZE": "3"},
            "WORLD_SIZE=4 but LOCAL_WORLD_SIZE=2 x GROUP_WORLD_SIZE=3",
        ),
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({**SLURM_TWO_NODES, "SLURM_PROCID": "8"}, "rank 8 is outside world size 8"),
        ({**SLURM_TWO_NODES, "SLURM_LOCALID": "4"}, "local rank 4 is outside local world size 4"),
        ({**SLURM_TWO_NODES, "SLURM_NODEID": "2"}, "node rank 2 is outside the 2 node(s)"),
        (
            {**SLURM_TWO_NODES, "SLURM_JOB_NODELIST": "gpu[01-03]"},
            "node list has 3 hosts but SLURM_NNODES=2",
        ),
        ({**SLURM_TWO_NODES, "SLURM_TASKS_PER_NODE": "4(x3)"}, "lists 3 nodes but the step has 2"),
        (
            {"MULTIGPU_JOB": '{"workers": {"devices_per_process": 0}}'},
            "MULTIGPU_JOB workers setting devices_per_process=0 is invalid",
        ),
    ],
)
def test_inconsistent_values_name_the_variable_and_give_a_hint(env, needle):
    with pytest.raises(WorldError) as info:
        detect_world(env)
    text = str(info.value)
    assert needle in text
    assert "HINT:" in text
    assert "\n" not in info.value.one_line()


def test_world_is_immutable():
    world = detect_world(TORCHRUN)
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        world.rank = 0  # type: ignore[misc]


def test_detect_reads_os_environ_by_default(monkeypatch):
    for key in list(TORCHRUN) + list(SLURM_TWO_NODES):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert detect_world().rank == 1


# ------------------------------------------------- hardening: ASCII whole numbers, bounded node lists


@pytest.mark.parametrize(
    "name, value",
    [
        ("RANK", "\u0663"),
        ("WORLD_SIZE", "\u0664"),
        ("WORLD_SIZE", "1_0"),
        ("RANK", " 3"),
        ("MASTER_PORT", "29_500"),
        ("RANK", "\u00b3"),
    ],
)
def test_torchrun_numbers_are_ascii_digits_only(name, value):
    """int() takes Arabic-Indic digits and underscores; a launcher's variable is digits 0-9 or an error."""
    with pytest.raises(WorldError) as info:
        detect_world({**TORCHRUN, name: value})
    assert (
        f"{name}=" in str(info.value)
        and "is not an integer" in str(info.value)
        and "HINT:" in str(info.value)
    )


@pytest.mark.parametrize(
    "name, value",
    [
        ("SLURM_PROCID", "\u0665"),
        ("SLURM_NNODES", "2_0"),
        ("SLURM_NODEID", "\u0661"),
        ("SLURM_RESTART_COUNT", "\uff11"),
    ],
)
def test_slurm_numbers_are_ascii_digits_only(name, value):
    with pytest.raises(WorldError, match=f"{name}=.* is not an integer.*HINT"):
        detect_world({**SLURM_TWO_NODES, name: value})


@pytest.mark.parametrize("bad", ["gpu[\u0661-\u0662]", "gpu[\u00b2]", "gpu[1-\u00b3]"])
def test_nodelist_ranges_are_ascii_digits(bad):
    with pytest.raises(WorldError, match="cannot parse.*HINT"):
        expand_nodelist(bad)


def test_tasks_per_node_and_job_ids_are_ascii_digits():
    with pytest.raises(WorldError, match="HINT"):
        expand_tasks_per_node("\u0664(x2)")
    assert slurm_port("12\u0663") == slurm_port("12")


def test_a_nodelist_is_expanded_up_to_65536_names():
    assert len(expand_nodelist("n[1-65536]")) == 65536
    assert len(expand_nodelist("r[1-256]-n[1-256]")) == 65536


@pytest.mark.parametrize(
    "huge",
    [
        "node[1-100000]",
        "n[0-99999999999999]",
        "r[1-1000]-n[1-1000]",
        "a[1-65536],b",
        "a[1-40000],b[1-40000]",
        "r[1-300]-n[1-300]-x[1-300]",
    ],
)
def test_a_nodelist_of_more_than_65536_names_is_one_line(huge):
    with pytest.raises(WorldError) as info:
        expand_nodelist(huge)
    assert "more than 65,536 nodes" in str(info.value) and "HINT:" in str(info.value)
    env = {**SLURM_TWO_NODES, "SLURM_JOB_NODELIST": huge}
    with pytest.raises(WorldError, match="more than 65,536"):
        detect_world(env)


def test_tasks_per_node_repeats_are_bounded():
    with pytest.raises(WorldError, match="more than 65,536 nodes.*HINT"):
        expand_tasks_per_node("1(x100000000)")


# ------------------------------------------------------------------ the job: what the starting command asks


def test_the_job_is_one_checked_variable_each_command_adds_its_section_to():
    """Issue 51: seven MULTIGPU_* variables (the queue's folder, memory share and trial channel, check's
    three, --profile), each a World field, became one JSON value with a section per request, handed on
    through launches of launches: each command sets its own section and keeps the rest."""
    import json

    from multigpu.distributed.job import JOB_VAR, Check, Job, job_env
    from multigpu.distributed.world import read_job

    assert read_job({}) == Job() and read_job({JOB_VAR: ""}) == Job()
    # the queue: a run's own job, nothing inherited
    queued = job_env(None, run_dir="/q/a", memory_fraction=0.5)
    # `multigpu run --profile` inside that queue run
    profiled = job_env(queued[JOB_VAR], profile=True)
    checked = job_env(profiled[JOB_VAR], check=Check("/c", 3, 2))
    assert read_job(checked) == Job(
        run_dir="/q/a", memory_fraction=0.5, profile=True, check=Check("/c", 3, 2)
    )
    assert json.loads(job_env(checked[JOB_VAR], check=None, memory_fraction=None)[JOB_VAR]) == {
        "run_dir": "/q/a",
        "profile": True,
    }  # a section set to None is gone
    assert json.loads(job_env(None)[JOB_VAR]) == {}


@pytest.mark.parametrize(
    "text, said",
    [
        ("{", "is not a JSON object"),
        ("[1, 2]", "is not a JSON object"),
        ('{"run_dri": "/x"}', "unknown key 'run_dri'"),
        ('{"memory_fraction": 1.5}', "memory_fraction=1.5 is invalid"),
        ('{"memory_fraction": NaN}', "memory_fraction=nan is invalid"),
        ('{"profile": 1}', "profile=1 is invalid"),
        ('{"run_dir": "  "}', "run_dir='  ' is invalid"),
        ('{"check": {"dir": "/c", "steps": 0}}', "steps=0 is invalid"),
        ('{"check": {"steps": 3}}', "missing"),
        ('{"check": "/c"}', "is not an object"),
        ('{"simulated_node": "yes"}', "simulated_node='yes' is invalid"),
        ('{"replica_launcher_pid": -1}', "replica_launcher_pid=-1 is invalid"),
        ('{"run_dir": "' + "x" * 70_000 + '"}', "bytes (at most 65,536)"),
        ("[" * 100_000 + "]" * 100_000, "bytes"),
    ],
)
def test_a_job_set_by_hand_is_one_line_naming_the_variable(text, said):
    from multigpu.distributed.world import read_job
    from multigpu.errors import WorldError

    with pytest.raises(WorldError, match=re.escape(said)) as caught:
        read_job({"MULTIGPU_JOB": text})
    assert "MULTIGPU_JOB" in caught.value.one_line() and "HINT:" in caught.value.one_line()


def test_the_jobs_writer_makes_its_folders_absolute_and_refuses_what_its_readers_would():
    """Fresh-eyes findings: a queue run's relative run_dir was a fence that moved with the script's current
    folder; a folder name its readers refuse (a lone surrogate) was written, and every rank failed blaming
    the user; duplicate keys were last-wins."""
    import json
    import os

    from multigpu.distributed.job import JOB_VAR, Check, job_env, parse_job

    written = json.loads(job_env(None, run_dir="q/run", check=Check("c"))[JOB_VAR])
    assert written == {
        "run_dir": os.path.abspath("q/run"),
        "check": {"dir": os.path.abspath("c"), "steps": 5, "scale": 1},
    }
    with pytest.raises(WorldError, match="give the run's folders names of plain text"):
        job_env(None, run_dir="/q/\udcff")
    for text, said in (
        ('{"run_dir": "q/run"}', "run_dir='q/run' is not an absolute path"),
        ('{"run_dir": "/a", "run_dir": "/b"}', "gives 'run_dir' twice"),
        ('{"memory_fraction": 5e-324}', "memory_fraction=5e-324 is invalid"),
    ):
        with pytest.raises(WorldError, match=re.escape(said)):
            parse_job(text)
