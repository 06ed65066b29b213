"""Launcher decisions without starting anything: devices per process, rendezvous, ports, device choice."""

import argparse
import json
import os
import socket
import sys
import time

import pytest
import torch

from multigpu.distributed.session import choose_backend, choose_devices
from multigpu.distributed.world import World, read_job
from multigpu.errors import LaunchError, WorldError
from multigpu.launch.devices import parse_gpu_ids, plan_devices
from multigpu.launch.local import LaunchRequest, worker_env
from multigpu.launch.ports import port_is_free, require_free_port, reserved_port, store_ports_held
from multigpu.launch.process import collector_paused
from multigpu.launch.rendezvous import parse_nnodes, plan_rendezvous
from multigpu.launch.torch_agent import cheap_method_names, method_name

FOUR = ["0", "1", "2", "3"]


def test_default_is_every_visible_gpu_one_process_each():
    plan = plan_devices(FOUR)
    assert (plan.nproc, plan.visible, plan.gpus_per_proc) == (4, "0,1,2,3", 1)


def test_no_gpu_and_no_flag_is_one_cpu_process():
    plan = plan_devices([])
    assert (plan.nproc, plan.visible) == (1, None)
    assert plan_devices([], nproc=3).nproc == 3


def test_gpus_flag_maps_indexes_onto_the_visible_list():
    assert plan_devices(FOUR, gpus="0,2,3").visible == "0,2,3"
    assert plan_devices(FOUR, gpus="0,2,3").nproc == 3
    # Slurm gave this shell physical GPUs 4-7: --gpus 1,3 means the 2nd and 4th of those.
    assert plan_devices(["4", "5", "6", "7"], gpus="1,3").visible == "5,7"
    assert plan_devices(FOUR, gpus="1-3").visible == "1,2,3"


def test_nproc_takes_the_first_gpus():
    assert plan_devices(FOUR, nproc=2).visible == "0,1"


def test_gpus_per_proc_groups_devices():
    plan = plan_devices(FOUR, gpus_per_proc=2)
    assert (plan.nproc, plan.visible, plan.gpus_per_proc) == (2, "0,1,2,3", 2)


def test_procs_per_gpu_shares_each_gpu():
    plan = plan_devices(FOUR, gpus="1", procs_per_gpu=2)
    assert (plan.nproc, plan.visible, plan.procs_per_gpu) == (2, "1", 2)
    assert (
        plan_devices(FOUR, procs_per_gpu=2).nproc,
        plan_devices(FOUR, procs_per_gpu=2).visible,
    ) == (8, "0,1,2,3")
    plan = plan_devices(FOUR, nproc=4, procs_per_gpu=2)
    assert (plan.nproc, plan.visible) == (4, "0,1")
    env = worker_env(LaunchRequest(("t.py",), plan, plan_rendezvous()))
    assert read_job(env).workers.processes_per_device == 2 and env["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize(
    "visible, kwargs, needle",
    [
        (FOUR, dict(nproc=3, procs_per_gpu=2), "--nproc 3 is not a multiple of --procs-per-gpu 2"),
        (FOUR, dict(nproc=10, procs_per_gpu=2), "needs 5 GPUs but 4 are visible"),
        (
            FOUR,
            dict(gpus="0", nproc=4, procs_per_gpu=2),
            "--nproc 4 contradicts --gpus 0 at --procs-per-gpu 2",
        ),
        (
            FOUR,
            dict(gpus_per_proc=2, procs_per_gpu=2),
            "--procs-per-gpu 2 and --gpus-per-proc contradict",
        ),
        (FOUR, dict(cpu=True, procs_per_gpu=2), "--procs-per-gpu 2 and --cpu contradict"),
        (FOUR, dict(procs_per_gpu=0), "--procs-per-gpu 0 must be at least 1"),
        ([], dict(procs_per_gpu=2), "--procs-per-gpu 2 needs a GPU but none is visible"),
        (FOUR, dict(gpus="0,9", procs_per_gpu=2), "GPU 9 does not exist"),
    ],
)
def test_impossible_sharing_requests_fail_with_a_hint(visible, kwargs, needle):
    with pytest.raises(LaunchError) as info:
        plan_devices(visible, **kwargs)
    assert needle in str(info.value) and "HINT:" in str(info.value)


def test_cpu_flag_hides_gpus():
    plan = plan_devices(FOUR, cpu=True, nproc=2)
    assert (plan.nproc, plan.visible) == (2, "")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(gpus="0,4"), "GPU 4 does not exist; 4 GPU(s) are visible"),
        (dict(gpus="0,0"), "names GPU 0 twice"),
        (dict(gpus="a"), "'a' is not a GPU index"),
        (dict(gpus="0,1,2", gpus_per_proc=2), "3 GPU(s) cannot be split into processes of 2 GPUs"),
        (dict(gpus="0,1", nproc=3), "--nproc 3 contradicts --gpus 0,1"),
        (dict(nproc=5), "5 process(es) x 1 GPU(s) each need 5 GPUs but 4 are visible"),
        (dict(nproc=3, gpus_per_proc=2), "need 6 GPUs but 4 are visible"),
        (dict(nproc=0), "--nproc 0 must be at least 1"),
        (dict(gpus_per_proc=0), "--gpus-per-proc 0 must be at least 1"),
        (dict(gpus="1", cpu=True), "--cpu and --gpus contradict"),
    ],
)
def test_impossible_device_requests_fail_with_a_hint(kwargs, needle):
    with pytest.raises(LaunchError) as info:
        plan_devices(FOUR, **kwargs)
    assert needle in str(info.value) and "HINT:" in str(info.value)


def test_gpus_on_a_cpu_machine_is_an_error():
    with pytest.raises(LaunchError, match="no GPU is visible"):
        plan_devices([], gpus="0")
    with pytest.raises(LaunchError, match="needs GPUs but none is visible"):
        plan_devices([], gpus_per_proc=2)


def test_parse_gpu_ids():
    assert parse_gpu_ids("0,2,3") == [0, 2, 3]
    assert parse_gpu_ids("0-2,5") == [0, 1, 2, 5]


# ----------------------------------------------------------------------------- rendezvous


def test_one_machine_uses_a_free_port_chosen_by_the_store():
    rdzv = plan_rendezvous()
    assert (rdzv.backend, rdzv.endpoint) == ("c10d", "localhost:0")
    assert plan_rendezvous().run_id != rdzv.run_id  # concurrent launches never share a rendezvous


def test_static_multi_node_follows_the_seed_recipe():
    rdzv = plan_rendezvous(nnodes="2", node_rank=1, master_addr="host1", master_port=5555)
    assert (rdzv.backend, rdzv.endpoint, rdzv.node_rank, rdzv.max_nodes) == (
        "static",
        "host1:5555",
        1,
        2,
    )
    assert rdzv.configs()["rank"] == 1


def test_elastic_needs_an_endpoint():
    with pytest.raises(LaunchError, match="--rdzv-endpoint"):
        plan_rendezvous(nnodes="1:4", master_addr="h", master_port=1)
    rdzv = plan_rendezvous(nnodes="1:4", rdzv_endpoint="host1:29400")
    assert (rdzv.backend, rdzv.min_nodes, rdzv.max_nodes) == ("c10d", 1, 4)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(nnodes="2", master_port=5555), "needs --master-addr"),
        (dict(nnodes="2", master_addr="h"), "needs --master-port"),
        (
            dict(nnodes="2", node_rank=2, master_addr="h", master_port=1),
            "--node-rank 2 is outside 0..1",
        ),
        (dict(nnodes="x"), "is not a number"),
        (dict(nnodes="3:2"), "need 0 < MIN <= MAX"),
        (dict(rdzv_endpoint="nohostport"), "is not HOST:PORT"),
        (dict(rdzv_endpoint="h:1", master_port=2), "both name the rendezvous"),
    ],
)
def test_bad_rendezvous_flags(kwargs, needle):
    with pytest.raises(LaunchError) as info:
        plan_rendezvous(**kwargs)
    assert needle in str(info.value) and "HINT:" in str(info.value)


def test_taken_master_port_is_refused_before_anything_starts():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert not port_is_free(port)
        with pytest.raises(LaunchError, match=f"--master-port {port} is already in use"):
            plan_rendezvous(master_port=port)
    assert port_is_free(port)
    with pytest.raises(LaunchError, match="not a valid port"):
        require_free_port(70000)


def test_imports_run_with_the_collector_paused_and_it_comes_back_as_it_was():
    import gc

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyboardInterrupt), collector_paused():
        # Ctrl-C during the import (the launcher's own stop signals raise too)
        raise KeyboardInterrupt
    assert gc.isenabled(), "an interrupted import leaves the collector on"
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled(), "a collector the user turned off stays off"
    finally:
        gc.enable()
    # (nothing of this process frozen before: unfreezing puts it back exactly)
    if gc.get_freeze_count() == 0:
        try:
            with collector_paused(freeze=True):
                kept = [[] for _ in range(1000)]
            assert gc.get_freeze_count() >= len(kept), "what the block allocated is frozen"
        finally:
            gc.unfreeze()


def test_only_the_commands_own_process_freezes_what_its_launcher_imports():
    """A Python process that calls multigpu.cli.main (a notebook) keeps its heap collectable; the multigpu
    command's entry point marks its own process."""
    import subprocess
    import sys

    from multigpu.launch import process

    assert not process.is_command_process(), "this pytest process is nobody's command"
    probe = (
        "import multigpu.cli, multigpu.launch.process as p, sys\n"
        "multigpu.cli.main = lambda: print(p.is_command_process()) or 0\n"
        "multigpu.cli.entry()"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stdout + done.stderr


def test_the_rendezvous_names_its_events_as_torch_does_during_a_launch_only(monkeypatch):
    """torch's get_method_name walks the stack with inspect (0.6-0.8 s of a forked launcher's CPU): ours reads
    the frame, gives the same name at every depth the stack has - the default depth too, through torch's own
    _record - and torch's function is back afterwards, also when the launch fails."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = dynamic_rendezvous.get_method_name

    def outer() -> list:
        return inner()

    def inner() -> list:
        names = []
        # a loop, not a comprehension: one frame fewer on Python < 3.12
        for depth in (1, 2, 3, 10_000):
            names.append(dynamic_rendezvous.get_method_name(depth))
        return names

    recorded: list = []
    monkeypatch.setattr(
        dynamic_rendezvous,
        "construct_and_record_rdzv_event",
        lambda **event: recorded.append(event["name"]),
    )
    handler = dynamic_rendezvous.DynamicRendezvousHandler.__new__(
        dynamic_rendezvous.DynamicRendezvousHandler
    )
    handler._settings = type("Settings", (), {"run_id": "r"})()
    handler._this_node = type("Node", (), {"addr": "host", "pid": 1, "local_id": 0})()
    # torch's call site, default depth: "<class>.<the method that records>"
    handler._record(message="m")

    expected = outer()
    assert expected[:2] == ["inner", "outer"] and expected[-1] == "no_method_name"
    with cheap_method_names():
        assert dynamic_rendezvous.get_method_name is method_name
        assert outer() == expected
        handler._record(message="m")
    assert dynamic_rendezvous.get_method_name is original
    assert recorded[0] == recorded[1], recorded
    with pytest.raises(RuntimeError), cheap_method_names():
        raise RuntimeError("a launch that fails")
    assert dynamic_rendezvous.get_method_name is original


def test_patches_of_launches_that_end_in_any_order_put_torchs_function_back_at_the_last():
    """Two launches in two threads: the first to start may end first. torch's function comes back when the
    last one ends, not before, and the ports picked meanwhile stay held until then."""
    import contextlib

    from torch.distributed.elastic.rendezvous import api, dynamic_rendezvous

    originals = (api.get_free_port, dynamic_rendezvous.get_method_name)
    with contextlib.ExitStack() as second_launch:
        with contextlib.ExitStack() as first_launch:
            first_launch.enter_context(store_ports_held())
            first_launch.enter_context(cheap_method_names())
            port = api.get_free_port()
            second_launch.enter_context(store_ports_held())
            second_launch.enter_context(cheap_method_names())
        # the first launch has ended, the second runs on
        assert (
            api.get_free_port is not originals[0]
            and dynamic_rendezvous.get_method_name is method_name
        )
        assert not plain_bind_works(port), "a port picked for a launch still running stays held"
    assert (api.get_free_port, dynamic_rendezvous.get_method_name) == originals
    assert plain_bind_works(port), "the last launch's end lets every held port go"


def test_a_swap_is_per_module_object_and_a_failing_last_exit_still_puts_the_original_back():
    import types

    from multigpu.launch.torch_agent import swapped

    def original() -> str:
        return "torch's"

    def ours() -> str:
        return "ours"

    # e.g. a module imported twice
    first, again = types.ModuleType("same.name"), types.ModuleType("same.name")
    first.f = again.f = original

    def fails() -> None:
        raise OSError("a socket that would not close")

    with swapped(first, "f", ours), swapped(again, "f", ours):
        assert first.f() == again.f() == "ours"
    assert first.f is original and again.f is original
    with pytest.raises(OSError), swapped(first, "f", ours, on_last_exit=fails):
        pass
    assert first.f is original
    # nothing left behind by the failure: the next block swaps again
    with swapped(first, "f", ours):
        assert first.f is ours


def plain_bind_works(port: int) -> bool:
    """A bind without SO_REUSEADDR: what a held port refuses (port_is_free, like a store, sets it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain:
        try:
            plain.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_reserved_port_is_given_to_nobody_else_but_a_store_still_binds_it():
    """reserve_port holds the port bound, not listening, on IPv6 and IPv4: a plain bind of it fails on
    either, and torch's TCPStore (SO_REUSEADDR; libuv's and the older backend) still listens there - rank
    0's store, whose port torch's agent picks when it builds the rendezvous' store information
    (store_ports_held: held until the launch ends, torch's own pick restored)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import api

    torchs = api.get_free_port
    with store_ports_held():
        # what the agent calls
        info = api.RendezvousStoreInfo.build(0, dist.HashStore(), "127.0.0.1")
        port = info.master_port
        for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            with socket.socket(family, socket.SOCK_STREAM) as plain, pytest.raises(OSError):
                plain.bind((address, port))
        for libuv in (True, False):
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                1,
                is_master=True,
                timeout=datetime.timedelta(seconds=30),
                use_libuv=libuv,
            )
            store.set("key", "value")
            assert store.get("key") == b"value"
            del store
    assert api.get_free_port is torchs
    with reserved_port() as held:
        # what --master-port checks (SO_REUSEADDR): a held port may be named
        assert port_is_free(held)


def test_parse_nnodes():
    assert parse_nnodes("2") == (2, 2)
    assert parse_nnodes("1:4") == (1, 4)


def test_worker_env_sets_devices_and_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    request = LaunchRequest(
        ("t.py",), plan_devices(FOUR, gpus="1,2", gpus_per_proc=2), plan_rendezvous()
    )
    env = worker_env(request)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert read_job(env).workers.devices_per_process == 2
    assert "OMP_NUM_THREADS" not in env  # one process: torch's own default
    env = worker_env(LaunchRequest(("t.py",), plan_devices([], nproc=2), plan_rendezvous()))
    assert int(env["OMP_NUM_THREADS"]) >= 1 and "CUDA_VISIBLE_DEVICES" not in env


# ----------------------------------------------------------------------------- in the worker


def test_device_choice_follows_local_rank_and_devices_per_process():
    world = World(rank=3, local_rank=1, world_size=4, local_world_size=2)
    assert choose_devices(world, cuda_count=2) == [torch.device("cuda", 1)]
    assert choose_devices(world, cuda_count=0) == [torch.device("cpu")]
    assert choose_devices(world, cuda_count=2, accelerator="cpu") == [torch.device("cpu")]
    paired = World(rank=1, local_rank=1, world_size=2, local_world_size=2, devices_per_process=2)
    assert choose_devices(paired, cuda_count=4) == [
        torch.device("cuda", 2),
        torch.device("cuda", 3),
    ]
    shared = [
        World(rank=r, local_rank=r, world_size=4, local_world_size=4, processes_per_device=2)
        for r in range(4)
    ]
    assert [choose_devices(w, cuda_count=2)[0].index for w in shared] == [0, 0, 1, 1]
    with pytest.raises(
        WorldError,
        match=r"local rank 3 needs GPU 1 but only 1 GPU\(s\) are visible; 4 process\(es\) "
        r"per node at 2 per GPU = 2",
    ):
        choose_devices(shared[3], cuda_count=1)


def test_processes_sharing_a_device_are_read_from_the_launcher():
    from multigpu.distributed.world import detect_world

    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234"}
    job = json.dumps({"workers": {"processes_per_device": 2}})
    assert detect_world({**env, "MULTIGPU_JOB": job}).processes_per_device == 2
    with pytest.raises(WorldError, match="share a device or own several, not both"):
        detect_world(
            {
                **env,
                "MULTIGPU_JOB": json.dumps(
                    {"workers": {"processes_per_device": 2, "devices_per_process": 2}}
                ),
            }
        )


def test_more_tasks_per_node_than_gpus_is_a_hint_error():
    world = World(
        rank=3,
        local_rank=3,
        world_size=8,
        local_world_size=4,
        source="slurm",
        visible_devices="0,1",
    )
    with pytest.raises(WorldError) as info:
        choose_devices(world, cuda_count=2)
    text = str(info.value)
    assert (
        "local rank 3 needs GPU 3 but only 2 GPU(s) are visible (CUDA_VISIBLE_DEVICES=0,1)" in text
    )
    assert "--ntasks-per-node" in text


def test_backend_choice():
    assert choose_backend(torch.device("cpu")) == "gloo"
    assert choose_backend(torch.device("cuda", 0)) == "nccl"
    assert choose_backend(torch.device("cuda", 0), "gloo") == "gloo"
    # NCCL: "Duplicate GPU detected"
    assert choose_backend(torch.device("cuda", 0), shared=True) == "gloo"
    with pytest.raises(LaunchError, match="cannot run several processes on one GPU"):
        choose_backend(torch.device("cuda", 0), "nccl", shared=True)
    with pytest.raises(LaunchError, match="nccl"):
        choose_backend(torch.device("cpu"), "nccl")
    with pytest.raises(LaunchError, match="unknown backend"):
        choose_backend(torch.device("cpu"), "tcp")


def test_root_cause_prefers_the_rank_that_started_it():
    from types import SimpleNamespace

    from multigpu.launch.reporting import root_cause

    def failure(exitcode, message="", timestamp=100):
        return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp)

    killed = failure(-9, "Signal 9 (SIGKILL) received by PID 7")
    stopped = failure(-15, "Signal 15 (SIGTERM) received by PID 6")
    lost = failure(1, "RuntimeError: Connection reset by peer", timestamp=99)
    own = failure(3, "ValueError: bad value", timestamp=101)
    assert root_cause({0: stopped, 1: killed})[0] == 1
    assert root_cause({0: lost, 1: own})[0] == 1
    assert root_cause({0: lost, 1: stopped})[0] == 1
    assert root_cause({0: own, 1: own})[0] == 0


def test_a_rank_stopped_during_its_teardown_keeps_the_status_it_recorded(tmp_path, capsys):
    """Seen once in a clean-clone run under load: both ranks raised the desync error (which counts as a
    peer's fault, so it ranks below a stopped rank); rank 0 left with 1, the agent's SIGTERM ended rank 1
    after it had recorded status 1 but before it left; the launcher reported 143 instead of 1."""
    from types import SimpleNamespace

    from multigpu.launch.attempts import write_record
    from multigpu.launch.reporting import report_failure, root_cause

    line = "multigpu: error: ranks disagree before training (1 difference(s)): x HINT: y"

    def failure(rank, exitcode):
        return SimpleNamespace(
            exitcode=exitcode,
            timestamp=100,
            local_rank=rank,
            pid=10 + rank,
            signal_name=lambda: "SIGTERM",
            message={"message": line, "extraInfo": {"multigpu_error": line}},
        )

    failures = {0: failure(0, 1), 1: failure(1, -15)}
    assert root_cause(failures)[0] == 1
    assert report_failure(failures, str(tmp_path)) == 143  # nothing recorded: the signal's status
    for rank in (0, 1):
        write_record(str(tmp_path), rank, 0, "pid", 10 + rank)
        write_record(str(tmp_path), rank, 0, "exit", 1)
    assert report_failure(failures, str(tmp_path)) == 1
    assert capsys.readouterr().err.count(line + " (on all 2 ranks)") == 2
    # a newer attempt that recorded nothing: its signal counts
    write_record(str(tmp_path), 1, 1, "pid", 20)
    assert report_failure(failures, str(tmp_path)) == 143
    write_record(str(tmp_path), 1, 1, "exit", 999)  # not an exit status: the signal's
    assert report_failure(failures, str(tmp_path)) == 143


def test_simulated_nodes_split_the_gpus():
    from multigpu.launch.flags import RunFlags
    from multigpu.launch.simulate import node_commands

    plain, cpu = RunFlags(), RunFlags(cpu=True)
    commands = node_commands(2, plain, ["t.py"], visible_gpus=4, gpus_flag=None, port=29500)
    assert [c[c.index("--gpus") + 1] for c in commands] == ["0,1", "2,3"]
    assert [c[c.index("--node-rank") + 1] if "--node-rank" in c else "0" for c in commands] == [
        "0",
        "1",
    ]
    # a script is never read as a launcher flag
    assert all(c[-2:] == ["--", "t.py"] for c in commands)
    commands = node_commands(2, plain, ["t.py"], visible_gpus=8, gpus_flag="4-7", port=29500)
    assert [c[c.index("--gpus") + 1] for c in commands] == ["4,5", "6,7"]
    assert all(
        "--gpus" not in c and "--cpu" in c
        for c in node_commands(2, cpu, ["t.py"], visible_gpus=0, gpus_flag=None, port=29500)
    )
    with pytest.raises(LaunchError, match="cannot be split evenly"):
        node_commands(2, plain, ["t.py"], visible_gpus=3, gpus_flag=None, port=29500)
    with pytest.raises(LaunchError, match="at least 2"):
        node_commands(1, plain, ["t.py"], visible_gpus=0, gpus_flag=None, port=29500)
    # with restarts the nodes meet in a c10d rendezvous: a static one cannot bring every node into a new round
    restarting = node_commands(
        2, RunFlags(max_restarts=1, cpu=True), ["t.py"], visible_gpus=0, gpus_flag=None, port=29500
    )
    assert all(
        c[c.index("--rdzv-endpoint") + 1] == "127.0.0.1:29500"
        and "--node-rank" not in c
        and "--master-port" not in c
        for c in restarting
    )


def test_restarts_across_nodes_of_a_static_rendezvous_are_refused_with_the_c10d_way(
    tmp_path, monkeypatch
):
    from multigpu.cli import build_parser
    from multigpu.commands.launching import plan_run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    args = build_parser().parse_args(
        [
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "29500",
            "--max-restarts",
            "1",
            "t.py",
        ]
    )
    with pytest.raises(LaunchError, match="restarts this node's workers only") as caught:
        plan_run(args)
    assert "--rdzv-endpoint HOST:PORT" in caught.value.hint


def test_run_flags_write_each_flag_once_and_the_target_last():
    from multigpu.launch.flags import RunFlags
    from multigpu.launch.interpreter import BOOTSTRAP

    flags = RunFlags(
        nproc=2, cpu=True, log_dir="out/logs", max_restarts=0, nnodes="1", exit_timeout=90
    )
    argv = flags.to_argv(["-m", "pkg.train", "--lr", "1"])
    assert argv == [
        sys.executable,
        "-P",
        "-m",
        "multigpu",
        "run",
        "--nproc",
        "2",
        "--log-dir",
        "out/logs",
        "--cpu",
        "-m",
        "pkg.train",
        "--lr",
        "1",
    ]
    # another interpreter (its version unknown here): -c, whose first line drops the current folder
    assert flags.to_argv(["t.py"], python="py")[:3] == [
        "py",
        "-c",
        BOOTSTRAP.format(module="multigpu"),
    ]
    assert RunFlags(nnodes="$SLURM_JOB_NUM_NODES").to_argv(["--help"], python="py")[-2:] == [
        "--",
        "--help",
    ]


def test_a_master_address_nobody_can_resolve_fails_in_seconds_not_after_the_rendezvous_timeout():
    from multigpu.launch.rendezvous import require_resolvable

    with pytest.raises(LaunchError, match="nothing.invalid is not a host this machine can resolve"):
        require_resolvable("nothing.invalid", "--master-addr")  # RFC 6761: .invalid never resolves
    require_resolvable("127.0.0.1", "--master-addr")
    require_resolvable("[::1]", "--rdzv-endpoint")


def test_ranks_waiting_for_run_on_main_say_so_early_and_then_less_often(capsys):
    """A wait longer than a few seconds is never silent: the first line after FIRST_NOTICE_S (here
    shortened), then at doubling intervals; one line for all the waiting ranks (rank 1 prints it)."""
    import time

    from multigpu.distributed.rank_zero import _wait_for

    class Store:
        def __init__(self, ready_after: float) -> None:
            self.ready_at = time.monotonic() + ready_after

        def check(self, keys):
            return time.monotonic() >= self.ready_at

        def get(self, key):
            return b"ok:none"

        def set(self, key, value):  # the rank's arrival (rank 0 waits for it before a broadcast)
            pass

        def add(self, key, amount):
            return amount

    assert (
        _wait_for(
            Store(0.6),
            "k",
            test_ranks_waiting_for_run_on_main_say_so_early_and_then_less_often,
            1,
            notice_every_s=10.0,
            others=3,
            first_notice_s=0.1,
        )
        == "ok:none"
    )
    lines = capsys.readouterr().err.splitlines()
    assert lines and all("ranks 1-3 wait for rank 0 to finish" in line for line in lines)
    assert len(lines) <= 3  # 0.1 s, then 0.2 s and 0.4 s later at most: doubling, not every poll
    assert (
        _wait_for(Store(0.3), "k", print, 2, notice_every_s=10.0, others=3, first_notice_s=0.05)
        == "ok:none"
    )
    assert capsys.readouterr().err == ""  # rank 2 stays quiet: rank 1 speaks for the waiting ranks


def test_rank_0_names_a_rank_that_skipped_run_on_main_before_it_broadcasts(capsys, monkeypatch):
    """nanoGPT's old ``if not os.path.exists(meta): run_on_main(prepare)``: a late rank sees the file rank 0
    has just made and skips the call (seen once in 13 runs of its test: a 200 s hang). Rank 0 must not
    broadcast its result into that rank's next collective: it waits in the store for every rank to arrive
    and names those that have not, with the fix, from FIRST_NOTICE_S on (shortened here). Both ranks run
    the real run_on_main (threads, one store); rank 1 comes only once rank 0 has named it."""
    import threading
    import types

    from multigpu.distributed import rank_zero

    class Store:  # torch's store: set, get, check, add (a count; add(k, 0) reads it)
        def __init__(self) -> None:
            self.values: dict = {}
            self.lock = threading.Lock()
            # rank 0 asked about rank 1's own key: a line is being written
            self.named = threading.Event()

        def set(self, key, value):
            with self.lock:
                self.values[key] = value.encode() if isinstance(value, str) else value

        def get(self, key):
            with self.lock:
                return self.values[key]

        def check(self, keys):
            if keys == ["multigpu/run_on_main/0/arrived/1"]:
                self.named.set()
            with self.lock:
                return all(k in self.values for k in keys)

        def add(self, key, amount):
            with self.lock:
                self.values[key] = int(self.values.get(key, 0)) + amount
                return self.values[key]

    class World:  # a process group (weakly referenced by run_on_main's call counter)
        pass

    class Groups:  # each rank its own (as each process has its own): its own count of calls
        worlds = (World(), World())

        @property
        def WORLD(self):
            return self.worlds[ranks.me]

    store, ranks, sent = Store(), threading.local(), []
    broadcast_done = threading.Event()

    def broadcast_object_list(box, src):
        if ranks.me == 0:
            sent.append(list(box))
            broadcast_done.set()
        else:
            assert broadcast_done.wait(10)
            box[:] = sent[0]

    monkeypatch.setattr(
        rank_zero,
        "dist",
        types.SimpleNamespace(
            is_available=lambda: True,
            is_initialized=lambda: True,
            get_world_size=lambda: 2,
            get_rank=lambda: ranks.me,
            group=Groups(),
            distributed_c10d=types.SimpleNamespace(_get_default_store=lambda: store),
            broadcast_object_list=broadcast_object_list,
        ),
    )
    monkeypatch.setattr(rank_zero, "FIRST_NOTICE_S", 0.05)
    results: dict = {}

    def rank(me: int) -> None:
        ranks.me = me
        if me == 1:
            assert store.named.wait(10), "rank 0 never named the missing rank"
        results[me] = rank_zero.run_on_main(lambda: "data/meta.json")

    threads = [threading.Thread(target=rank, args=(me,), daemon=True) for me in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)  # the bound of a hang (it takes a fraction of a second)
    assert results == {0: "data/meta.json", 1: "data/meta.json"}
    assert sent == [["data/meta.json"]]
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(
        line.startswith("multigpu: rank 0 waits for rank(s) 1 to call run_on_main(")
        and "HINT: if a rank skips the call" in line
        for line in lines
    ), lines


STOPS_PROBE = """\
import os, signal
from multigpu.launch.process import StopSignals, Stopped, agent_signal_handlers, install_stops, restore_stops

ALL = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT)
def mine(*_):
    pass
signal.signal(signal.SIGUSR1, mine)
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup's
before = [signal.getsignal(s) for s in ALL]
stops, saved = StopSignals(), agent_signal_handlers()
try:
    install_stops(stops, saved)
    with stops.held():
        os.kill(os.getpid(), signal.SIGTERM)
        print("held", stops.came == signal.SIGTERM, flush=True)
except Stopped as stopped:  # at the end of held, once
    print("after held", stopped.signum == signal.SIGTERM, stops.came, flush=True)
os.kill(os.getpid(), signal.SIGHUP)  # ignored before, ours now (torch's agent handles it all the same)
print("then noted", stops.came == signal.SIGHUP, flush=True)  # a stop already raised: the next one waits
stops = StopSignals()  # a fresh start: the first stop raises, the second is only noted
install_stops(stops, saved)
try:
    os.kill(os.getpid(), signal.SIGQUIT)
except Stopped as stopped:
    print("raised", stopped.signum == signal.SIGQUIT, flush=True)
os.kill(os.getpid(), signal.SIGINT)
print("noted", stops.came == signal.SIGINT, flush=True)
signal.signal(signal.SIGTERM, lambda *_: None)  # as torch's agent leaves its handlers
restore_stops(stops, saved, deliver=False)  # the launch ended on a stop: its status stands
print("restored", [signal.getsignal(s) for s in ALL] == before, flush=True)
"""


def test_the_launchers_stop_handler_holds_raises_once_and_puts_every_handler_back():
    """launch.process's stop handler, as launch() uses it: a stop inside held() waits for its end and is
    raised once; the first stop raises and a second is only noted; every handler (ignored ones and a
    program's own included) is back afterwards, and torch's is gone."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", STOPS_PROBE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "held True",
        "after held True None",
        "then noted True",
        "raised True",
        "noted True",
        "restored True",
    ], done.stdout + done.stderr


def _sample(knob):
    """A value of this knob other than its default, as the parser would give it."""
    from multigpu.launch.knobs import nproc_value
    from multigpu.validate import whole_flag

    if knob.switch:
        return True
    if knob.choices:
        return knob.choices[-1]
    return {whole_flag: 7, float: 2.5, nproc_value: 3}.get(knob.type, "host-7")


def test_each_launch_knob_is_one_flag_its_child_lines_carry_and_its_bounds_are_checked(
    tmp_path, monkeypatch
):
    """Issue 51: a launch flag is declared once (launch/knobs.py). Derived from it, and checked here to
    agree: `multigpu run`'s parser (every spelling, the dest, the default), the child `multigpu run` lines
    RunFlags writes (each handed-on knob's value reads back the same through the parser) and the bounds."""
    from multigpu.cli import build_parser
    from multigpu.commands.launching import _check_run_flags
    from multigpu.launch.flags import RunFlags
    from multigpu.launch.knobs import KNOBS

    parser = build_parser()
    run = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "run"
    ]
    by_flag = {flag: action for action in run._actions for flag in action.option_strings}
    for knob in KNOBS:
        for flag in knob.spellings():
            assert by_flag[flag].dest == knob.name and by_flag[flag].default == knob.default, flag
        if knob.handed_on:
            value = _sample(knob)
            args = parser.parse_args(["run", *RunFlags(**{knob.name: value}).flags(), "t.py"])
            assert getattr(args, knob.name) == value, knob.name
    with pytest.raises(TypeError, match="no launch flag 'fresh'"):
        RunFlags(fresh=True)  # shapes this line only: never handed to a child
    monkeypatch.chdir(tmp_path)
    for line, said in (
        (["--max-restarts", "1001"], "--max-restarts 1001 is more than 1,000"),
        (["--master-port", "0"], "--master-port 0 must be at least 1"),
        (
            ["--monitor-interval", "0"],
            "--monitor-interval 0.0 must be a positive number of seconds",
        ),
        (["--role", "a b"], "--role"),
    ):
        with pytest.raises(LaunchError, match=said):
            _check_run_flags(parser.parse_args(["run", *line, "t.py"]))


def test_a_launch_of_launches_hands_each_child_every_flag_of_its_line():
    """Each child got a hand-picked list of flags: replica groups dropped --exit-timeout, --profile and
    --rdzv-timeout, simulated nodes --tee-prefix. Now every handed-on flag reaches each child (RunFlags.from_args),
    then the child's own are set."""
    from multigpu.cli import build_parser
    from multigpu.launch.flags import RunFlags
    from multigpu.launch.simulate import node_commands

    args = build_parser().parse_args(
        [
            "run",
            "--simulate-nodes",
            "2",
            "--cpu",
            "--exit-timeout",
            "30",
            "--profile",
            "--tee-prefix",
            "never",
            "--rdzv-timeout",
            "60",
            "t.py",
        ]
    )
    flags = RunFlags.from_args(args).replace(simulate_nodes=None)
    for command in node_commands(2, flags, ["t.py"], visible_gpus=0, gpus_flag=None, port=29500):
        assert "--simulate-nodes" not in command and "--profile" in command
        assert [
            command[command.index(f) + 1]
            for f in ("--exit-timeout", "--tee-prefix", "--rdzv-timeout")
        ] == ["30", "never", "60"]


_IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


def _started(children, code):
    """A child that ignores SIGTERM, once it is up (its handler set)."""
    children.start([sys.executable, "-c", code], None)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and children.procs[-1].poll() is None:
        try:
            if (
                "S"
                in open(f"/proc/{children.procs[-1].pid}/stat").read().rsplit(")", 1)[1].split()[0]
            ):
                break  # asleep in time.sleep: its handler is set
        except OSError:
            break
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_the_children_of_a_launch_of_launches_stop_as_one(no_leftovers):
    """Issue 51: simulated nodes and replica groups share one supervisor (launch/children.py). A child that
    fails can stop the others; the first stop signal is forwarded and starts the deadline, the deadline or a
    second signal ends what still runs with SIGKILL (simulated nodes waited 30 s for a second Ctrl-C)."""
    import signal

    from multigpu.launch.children import Children

    # a failure stops the others
    with Children((signal.SIGTERM,), grace_s=60, poll_s=0.02) as children:
        children.start(
            [sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(3)"], None
        )
        children.start([sys.executable, "-c", "import time; time.sleep(60)"], None)
        assert children.watch(lambda index, code: code != 0) == {0: 3, 1: -signal.SIGTERM}
    # the deadline after a stop
    with Children((signal.SIGTERM,), grace_s=0.3, poll_s=0.02) as children:
        _started(children, _IGNORES_TERM)
        # to this process, which forwards it; the child ignores it
        os.kill(os.getpid(), signal.SIGTERM)
        assert children.watch(lambda index, code: False) == {0: -signal.SIGKILL}
        assert children.received == [signal.SIGTERM]
    began = time.monotonic()
    # a second stop: at once
    with Children((signal.SIGTERM,), grace_s=600, poll_s=0.02) as children:
        _started(children, _IGNORES_TERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        assert children.watch(lambda index, code: False) == {0: -signal.SIGKILL}
    assert time.monotonic() - began < 60  # not the 600 s deadline
    with pytest.raises(RuntimeError), Children((signal.SIGTERM,), grace_s=600) as children:
        children.start([sys.executable, "-c", "import time; time.sleep(60)"], None)
        raise RuntimeError("the launcher failed")
    # nothing left running, whatever ended the block
    assert children.procs[0].poll() == -signal.SIGKILL


def test_fresh_eyes_launch_flag_findings(tmp_path, monkeypatch):
    """A value that starts with '-' was two words in a child's line (its flag then lost its value); a
    --rdzv-conf value was cut to 9 digits and a second one silently won; a folder, a FIFO or a device were
    all "does not exist"; a poll interval of 1e-300 s was a busy loop; --min-replicas and
    --heartbeat-timeout had no bounds of their own."""
    from multigpu.cli import build_parser
    from multigpu.commands.launching import _check_run_flags, fold_torchrun_flags
    from multigpu.launch.flags import RunFlags
    from multigpu.launch.local import split_command

    parser = build_parser()
    line = RunFlags(log_dir="-x/logs", rdzv_id="-y", nproc=2).flags()
    assert line == ["--nproc", "2", "--rdzv-id=-y", "--log-dir=-x/logs"]
    args = parser.parse_args(["run", *line, "t.py"])
    assert (args.log_dir, args.rdzv_id) == ("-x/logs", "-y")
    args = parser.parse_args(["run", "--rdzv-conf", "join_timeout=0000000000900", "t.py"])
    fold_torchrun_flags(args)
    assert args.rdzv_timeout == 900
    with pytest.raises(LaunchError, match="more than once"):
        fold_torchrun_flags(
            parser.parse_args(["run", "--rdzv-conf", "join_timeout=900,timeout=5", "t.py"])
        )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for target, said in (
        ("pkg", "is a folder"),
        ("fifo", "not a regular file"),
        ("/dev/zero", "not a regular file"),
        ("nothere.py", "does not exist"),
    ):
        with pytest.raises(LaunchError, match=said):
            split_command(target, None, [])
    for flags, said in (
        (["--monitor-interval", "1e-300"], "shorter than 0.01 s"),
        (["--min-replicas", "0"], "--min-replicas 0 must be at least 1"),
        (["--heartbeat-timeout", "nan"], "--heartbeat-timeout nan must be a positive number"),
    ):
        with pytest.raises(LaunchError, match=said):
            _check_run_flags(parser.parse_args(["run", *flags, "t.py"]))
