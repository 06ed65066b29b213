"""``multigpu run`` with real processes on CPU/gloo: all_reduce, torchrun, failures, signals, ports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import PY, SCRIPTS, child_env, listening, multigpu, wait_for_files, wait_until_gone

# A test here launches one or two short 2-process runs (each up to ~1 min on 2 busy cores, capped at 60-180 s
# by its own subprocess timeout); a hang ends here.
pytestmark = pytest.mark.timeout(240)
ALLREDUCE = str(SCRIPTS / "allreduce.py")


def _records(stdout: str) -> list[dict]:
    return sorted(
        (json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )


def _assert_all_reduced_on_2(proc: subprocess.CompletedProcess) -> None:
    """``multigpu run --nproc 2 allreduce.py``: both ranks, the sum, gloo, and torch's agent underneath."""
    assert proc.returncode == 0, proc.stderr
    records = _records(proc.stdout)
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["sum"] == 3.0 and r["world_size"] == 2 and r["backend"] == "gloo" for r in records)
    # multigpu run is torch's elastic agent underneath
    assert all(r["source"] == "torchrun" for r in records)
    # each rendezvous round a fresh store of rank 0's: no keys of an earlier attempt (its port: the launcher
    # holds it from the agent's pick on, tests/test_launch_plan.py)
    assert not any(r["agent_store"] for r in records), records
    assert "terminate called" not in proc.stderr


def test_no_flags_on_a_cpu_machine_is_one_process(no_leftovers):
    proc = multigpu("run", ALLREDUCE, no_leftovers, check=True)
    assert [(r["rank"], r["world_size"], r["sum"]) for r in _records(proc.stdout)] == [(0, 1, 1.0)]


def test_same_script_under_plain_torchrun(no_leftovers):
    proc = subprocess.run(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            ALLREDUCE,
            no_leftovers,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert [(r["rank"], r["sum"]) for r in _records(proc.stdout)] == [(0, 3.0), (1, 3.0)]


def test_same_script_as_a_plain_process(no_leftovers):
    proc = subprocess.run(
        [PY, ALLREDUCE, no_leftovers], capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert _records(proc.stdout)[0]["source"] == "single"


def test_module_target(no_leftovers):
    proc = multigpu("run", "--nproc", "2", "-m", "pkg.hello", "--flag", no_leftovers, check=True)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("module"))
    assert lines == [
        f"module rank {r} of 2 args ['--flag', '{no_leftovers}'] name __main__" for r in (0, 1)
    ]


#: Launches in the shutdown test. A bare destroy_process_group aborted 19 of 40 two-process launches here
#: (worker.py): a launch survives that bug with probability 21/40 = 0.525, so 30 launches all pass by luck
#: with probability 0.525**30 = 4e-9. A soak test (make soak): every 2-process launch of the suite (about
#: 200, each checking its exit status) would meet such an abort too; this one counts them in a row.
SHUTDOWN_LAUNCHES = 30


@pytest.mark.soak
# 30 launches of ~5 s each, up to ~15 s each on a loaded machine; a hung shutdown still ends here.
@pytest.mark.timeout(900)
def test_repeated_launches_never_abort_at_shutdown(no_leftovers):
    """A bare destroy_process_group aborts in a fraction of runs; ours must not, over SHUTDOWN_LAUNCHES launches."""
    failures = []
    for attempt in range(SHUTDOWN_LAUNCHES):
        proc = multigpu("run", "--nproc", "2", ALLREDUCE, no_leftovers)
        if (
            proc.returncode != 0
            or "terminate called" in proc.stderr
            or len(_records(proc.stdout)) != 2
        ):
            failures.append((attempt, proc.returncode, proc.stderr[-500:]))
    assert failures == []


def test_two_concurrent_launches_both_succeed_one_on_a_port_of_its_own(no_leftovers):
    """Two launches at once (each must find its own ports; one is given --master-port, a free port), each the
    plain 2-process all-reduce."""
    from multigpu.launch.ports import reserved_port

    # a port nobody else is given meanwhile
    with reserved_port() as port, ThreadPoolExecutor(2) as pool:
        procs = list(
            pool.map(
                lambda flags: multigpu("run", "--nproc", "2", *flags, ALLREDUCE, no_leftovers),
                [(), ("--master-port", str(port))],
            )
        )
    _assert_all_reduced_on_2(procs[0])
    # a static rendezvous on that port: its own store
    assert procs[1].returncode == 0, procs[1].stderr
    assert [r["sum"] for r in _records(procs[1].stdout)] == [3.0, 3.0]


def test_failing_rank_gives_its_exit_code_name_and_stderr(no_leftovers):
    proc = multigpu("run", "--nproc", "2", ALLREDUCE, "--fail-rank", "1", no_leftovers)
    assert proc.returncode == 3, proc.stderr
    assert "error: rank 1 (local rank 1" in proc.stderr and "exited with code 3" in proc.stderr
    summary = proc.stderr.split("error: rank 1", 1)[1]
    # the tail of its stderr is repeated in the summary
    assert "rank 1 is failing on purpose" in summary


def test_python_exception_in_a_worker(tmp_path, no_leftovers):
    script = tmp_path / "boom.py"
    script.write_text(
        "import multigpu as mg\nrun = mg.init(timeout_s=20)\n"
        "if run.rank == 0:\n    raise ValueError('bad value in rank zero')\n"
    )
    proc = multigpu("run", "--nproc", "2", str(script), no_leftovers)
    assert proc.returncode == 1
    assert "error: rank 0" in proc.stderr
    assert "ValueError: bad value in rank zero" in proc.stderr.split("error: rank 0", 1)[1]


@pytest.mark.parametrize(
    "share, needle",
    [
        ("", "multigpu: error: out of GPU memory. HINT: lower the per-process batch size"),
        (
            "0.25",
            "multigpu: error: out of GPU memory in a packed queue run, which may use 0.25 of the GPU. HINT: give "
            "this run more of the GPU",
        ),
    ],
)
def test_out_of_memory_names_what_to_change(share, needle, no_leftovers):
    proc = multigpu(
        "run",
        str(SCRIPTS / "oom.py"),
        env={"MULTIGPU_JOB": json.dumps({"memory_fraction": float(share)}) if share else ""},
    )
    assert proc.returncode == 1
    assert "OutOfMemoryError: CUDA out of memory" in proc.stderr  # the traceback still says where
    assert needle in proc.stderr and proc.stderr.count(needle) == 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_every_worker_and_leaves_no_orphan(tmp_path, no_leftovers, sig):
    launcher = subprocess.Popen(
        [
            PY,
            "-m",
            "multigpu",
            "run",
            "--nproc",
            "2",
            str(SCRIPTS / "sleeper.py"),
            str(tmp_path),
            no_leftovers,
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_files(tmp_path, ["pid0", "pid1"], timeout=60)
        workers = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + sig
    assert f"stopped by {sig.name}" in err
    assert wait_until_gone(no_leftovers) == []
    for pid in workers:
        assert (
            not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
        )


@pytest.mark.parametrize(
    "backend, sig", [("static", signal.SIGINT), ("static", signal.SIGTERM), ("c10d", signal.SIGINT)]
)
def test_a_stop_while_waiting_for_the_other_node_ends_the_launcher_in_seconds(
    no_leftovers, backend, sig
):
    """One node of two: the launcher waits. Once its store listens, a static rendezvous waits inside C++
    (torch's TCPStore, for the other node), where no Python handler runs until the 300 s rendezvous timeout;
    c10d's wait is Python's. Either way the stop ends it within seconds (60 s: the bound of a hang, not of
    speed), with its line and status, and removes its folders."""
    from multigpu.launch.ports import reserved_port

    temp = Path(tempfile.mkdtemp(prefix="mgt-", dir="/tmp"))
    with reserved_port() as port:
        where = (
            ["--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port)]
            if backend == "static"
            else ["--rdzv-endpoint", f"127.0.0.1:{port}"]
        )
        launcher = subprocess.Popen(
            [
                PY,
                "-m",
                "multigpu",
                "run",
                "--nproc",
                "1",
                "--nnodes",
                "2",
                *where,
                "--rdzv-timeout",
                "300",
                ALLREDUCE,
                no_leftovers,
            ],
            env=child_env({"TMPDIR": str(temp)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not listening(port) and launcher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert listening(port), "the launcher's store never listened"
            launcher.send_signal(sig)
            sent = time.monotonic()
            _, err = launcher.communicate(timeout=60)
            took = time.monotonic() - sent
        finally:
            launcher.kill()
            leftovers = [p.name for p in temp.iterdir()]
            shutil.rmtree(temp, ignore_errors=True)
    assert launcher.returncode == (130 if sig == signal.SIGINT else 128 + sig), err
    assert (
        f"multigpu: stopped by {sig.name} while waiting for the other nodes; no worker had started."
        in err
    )
    assert "Traceback" not in err and took < 60
    assert leftovers == []
    assert wait_until_gone(no_leftovers) == []


def test_sigkill_of_the_launcher_takes_the_workers_with_it(tmp_path, no_leftovers):
    launcher = subprocess.Popen(
        [
            PY,
            "-m",
            "multigpu",
            "run",
            "--nproc",
            "2",
            str(SCRIPTS / "sleeper.py"),
            str(tmp_path),
            no_leftovers,
        ],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_files(tmp_path, ["pid0", "pid1"], timeout=60)
    launcher.kill()
    launcher.wait(timeout=10)
    assert wait_until_gone(no_leftovers) == []


def test_taken_master_port_fails_at_once_with_a_hint(no_leftovers):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        proc = multigpu("run", "--nproc", "2", "--master-port", str(port), ALLREDUCE, no_leftovers)
    assert proc.returncode == 2
    assert time.monotonic() - started < 15
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert (
        lines == [lines[0]]
        and f"--master-port {port} is already in use" in lines[0]
        and "HINT:" in lines[0]
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--gpus", "0", ALLREDUCE], "no GPU is visible"),
        (["--nproc", "0", ALLREDUCE], "--nproc 0 must be at least 1"),
        (["no_such_script.py"], "does not exist"),
        (["--nnodes", "2", ALLREDUCE], "needs --master-addr"),
        (["--max-restarts", "-1", ALLREDUCE], "--max-restarts -1"),
    ],
)
def test_bad_input_is_one_line_with_a_hint(args, needle):
    proc = multigpu("run", *args, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr and "HINT:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_on_main_once_longer_than_the_timeout_and_shared(tmp_path, no_leftovers):
    proc = multigpu(
        "run", "--nproc", "2", str(SCRIPTS / "prepare_once.py"), str(tmp_path), no_leftovers
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "prepared.txt").read_text() == "prepared by rank 0\n"
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert (
        results[0]
        == results[1]
        == {"result": {"items": 101, "by": 0}, "second": 0, "nothing": None}
    )
    assert proc.stdout.count("printed once") == 1


def test_run_on_main_failure_stops_every_rank(tmp_path, no_leftovers):
    proc = multigpu(
        "run",
        "--nproc",
        "2",
        str(SCRIPTS / "prepare_once.py"),
        str(tmp_path),
        "--fail",
        no_leftovers,
    )
    assert proc.returncode == 1
    assert "error: rank 0" in proc.stderr and "RuntimeError: the dataset is broken" in proc.stderr


def test_run_on_main_failure_raises_on_the_waiting_ranks_too(tmp_path, no_leftovers):
    """Without a launcher to stop them (plain RANK/WORLD_SIZE processes), the waiting rank raises too."""
    from multigpu.launch.ports import reserved_port

    with reserved_port() as port:  # rank 0's store binds it; nobody else is given it meanwhile
        procs = [
            subprocess.Popen(
                [PY, str(SCRIPTS / "prepare_once.py"), str(tmp_path), "--fail", no_leftovers],
                env=child_env(
                    {
                        "RANK": str(r),
                        "WORLD_SIZE": "2",
                        "LOCAL_RANK": str(r),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                    }
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]
        results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    assert "RuntimeError: the dataset is broken" in results[0][1]
    # rank 0's error reached it, or the store rank 0 hosted vanished first: either way it says so
    assert (
        "run_on_main(prepare) failed on rank 0" in results[1][1]
        or "run_on_main(prepare) lost rank 0" in results[1][1]
    )


LATE_RANK = """\
import os, sys, time
from pathlib import Path
out, rank = Path(sys.argv[1]), int(os.environ["RANK"])

def wait_for(name):
    deadline = time.monotonic() + 120
    while not (out / name).exists() and time.monotonic() < deadline:
        time.sleep(0.05)

import torch, torch.distributed as dist
import multigpu as mg
if rank == 1:
    wait_for("rank0-joining")
    time.sleep(7)  # joins 7 s after rank 0 began to wait: longer than the 5 s collective timeout
else:
    (out / "rank0-joining").touch()
run = mg.init(timeout_s=5)
if rank == 1:
    wait_for("rank0-done")  # never enters the collective: rank 0's must fail, after the collective timeout
    sys.exit(0)
started = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
    print("reduced")
except RuntimeError:
    print(f"failed after {time.monotonic() - started:.1f} s")
(out / "rank0-done").touch()
os._exit(0)
"""


def test_a_late_rank_joins_and_the_collective_timeout_holds_after(tmp_path, no_leftovers):
    """``mg.init(timeout_s=5)``: a rank that starts later than that still joins (start-up is not a
    collective: a short timeout must not make joining depend on load), and a collective then fails after
    the 5 s, not after the join's 600 s."""
    from multigpu.launch.ports import reserved_port

    with reserved_port() as port:
        procs = [
            subprocess.Popen(
                [PY, "-c", LATE_RANK, str(tmp_path), no_leftovers],
                env=child_env(
                    {
                        "RANK": str(r),
                        "WORLD_SIZE": "2",
                        "LOCAL_RANK": str(r),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                    }
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]
        results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    line = results[0][0].strip()
    assert line.startswith("failed after "), results[0]
    assert float(line.split()[2]) < 60, line  # 5 s and some load; the join's 600 s would be a hang


def test_help_documents_every_option():
    proc = multigpu("run", "--help", check=True)
    for flag in (
        "--gpus",
        "--nproc",
        "--gpus-per-proc",
        "--cpu",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--rdzv-endpoint",
        "--max-restarts",
        "--log-dir",
        "-m",
        "examples:",
    ):
        assert flag in proc.stdout


def test_the_gpu_path_checks_hold_on_cpu_processes_too(tmp_path, no_leftovers):
    """tests/scripts/gpu_paths.py is what the GPU tier runs on a GPU; here its code path runs on two CPU
    processes, so a mistake in the script (not a CUDA difference) shows up on every machine. Both CPU
    checks in one launch."""
    proc = multigpu(
        "run",
        "--nproc",
        "2",
        str(SCRIPTS / "gpu_paths.py"),
        "init,fsdp_dcp",
        str(tmp_path),
        no_leftovers,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for check in ("init", "fsdp_dcp"):
        records = sorted((r for r in found if r["check"] == check), key=lambda r: r["rank"])
        assert [(r["device"], r["world_size"]) for r in records] == [("cpu", 2), ("cpu", 2)], check
        if check == "init":
            assert [(r["backend"], r["sum"]) for r in records] == [("gloo", 3.0), ("gloo", 3.0)]
        else:
            assert (
                all(r["resumed"] and r["sharded"] for r in records) and records[0]["equal"] is True
            )


RESTARTED = """\
import os, sys, torch.distributed as dist
dist.init_process_group("gloo")
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
    os._exit(3)  # the first attempt of rank 1 fails
dist.barrier()
# the node launcher's word from --simulate-nodes is the launcher's own: its workers do not inherit it
assert '"simulated_node"' not in os.environ.get("MULTIGPU_JOB", ""), os.environ["MULTIGPU_JOB"]
sys.stdout.write(f"rank {dist.get_rank()} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} ok\\n")  # one write
sys.stdout.flush()
dist.destroy_process_group()
"""


def test_simulated_nodes_restart_together_and_never_ask_the_user_to_start_them(
    tmp_path, no_leftovers
):
    """--simulate-nodes 2 --max-restarts 1: the restarted worker of one node could not reach the other's
    (a static rendezvous restarts one node's workers only); each node also asked the user to start the
    others, which the command does itself."""
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    proc = multigpu(
        "run",
        "--simulate-nodes",
        "2",
        "--nproc",
        "1",
        "--max-restarts",
        "1",
        str(script),
        no_leftovers,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if "attempt" in line) == [
        "rank 0 attempt 1 ok",
        "rank 1 attempt 1 ok",
    ]
    assert "start the same command on the other nodes" not in proc.stderr
    assert proc.stderr.count("the other simulated nodes start here too") == 2
