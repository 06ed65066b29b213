"""One way to start a worker - a new interpreter per rank under torch's agent, as torchrun starts them - and
what it promises: the path a user's program sees, no file of the current folder imported, a worker that does
not exit named and ended, nothing left in the temporary folder.

A program in the shape of the PyTorch DDP tutorial series (tests/scripts/ddp_tutorial: no multigpu import,
beside the tutorial's own ``multigpu.py``) is the user's program here. ``make soak`` runs it 30 times in a
row under ``multigpu run`` and under torchrun (:func:`test_the_tutorials_program_never_hangs_at_exit`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PY, SCRIPTS, child_env, multigpu

from multigpu.errors import EXIT_STUCK_AT_EXIT
from multigpu.launch.interpreter import BOOTSTRAP, python_module

pytestmark = pytest.mark.timeout(300)
TUTORIAL = SCRIPTS / "ddp_tutorial"
#: What a planted module does when imported: say so on stderr (the test reads every output).
PLANT = "import sys\nsys.stderr.write('PLANTED {name} was imported\\n')\n"
PROBE = """\
import json, os, sys
print(json.dumps({"path0": sys.path[0], "cwd_on_path": os.getcwd() in sys.path or "" in sys.path,
                  "json": json.__file__}))
"""


def _plant(folder: Path, *names: str) -> None:
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PLANT.format(name=name))


@pytest.mark.parametrize("python", [sys.executable, "other"])
def test_a_child_python_never_has_the_current_folder_on_its_path(tmp_path, python):
    """python -P -m (this interpreter, 3.11+) and -c with the bootstrap line (any other interpreter: 3.10,
    a Slurm script's): the current folder is not on sys.path, a json.py there is not what `import json` finds,
    and sys.argv is what `python -m` gives."""
    _plant(tmp_path, "json.py", "runpy.py", "probe_target/__init__.py")
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "probe_mod.py").write_text(PROBE + "print(json.dumps(sys.argv[1:]))\n")
    argv = python_module("probe_mod", PY if python == "other" else python)
    if python == "other":  # PY is this interpreter: compare it as if its version were unknown
        argv = [PY, "-c", BOOTSTRAP.format(module="probe_mod")]
    assert argv[1:3] == (
        ["-P", "-m"] if python != "other" else ["-c", BOOTSTRAP.format(module="probe_mod")]
    )
    proc = subprocess.run(
        [*argv, "a", "--b"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        env={**child_env(), "PYTHONPATH": str(tmp_path / "mods")},
    )
    assert proc.returncode == 0 and "PLANTED" not in proc.stderr, proc.stderr
    seen, args = (json.loads(line) for line in proc.stdout.splitlines())
    assert not seen["cwd_on_path"] and not seen["json"].startswith(str(tmp_path)), seen
    assert args == ["a", "--b"]


@pytest.fixture(scope="module")
def tutorial_run(tmp_path_factory) -> dict:
    """One launch, read by several tests: the tutorial's program, started from its own folder (its
    ``multigpu.py`` there, and a planted ``json.py`` and ``multigpu/`` package) with TMPDIR an empty folder."""
    root = tmp_path_factory.mktemp("tutorial")
    folder = root / "ddp-tutorial-series"
    shutil.copytree(TUTORIAL, folder)
    _plant(folder, "json.py", "signal.py", "multigpu/__init__.py")
    temp = root / "tmp"
    temp.mkdir()
    started = time.monotonic()
    proc = multigpu(
        "run",
        "--nproc",
        "2",
        "multigpu_torchrun.py",
        "2",
        "1",
        cwd=folder,
        env={"TMPDIR": str(temp)},
        timeout=240,
    )
    return {"proc": proc, "folder": folder, "temp": temp, "seconds": time.monotonic() - started}


def test_the_tutorials_program_runs_unchanged_from_its_own_folder(tutorial_run):
    proc = tutorial_run["proc"]
    assert proc.returncode == 0, proc.stderr
    # its multigpu.py, a json.py, a multigpu/ package
    assert "PLANTED" not in proc.stdout + proc.stderr
    assert sorted(re.findall(r"\[GPU(\d)\] Epoch 1", proc.stdout)) == ["0", "1"], proc.stdout
    assert (tutorial_run["folder"] / "snapshot.pt").is_file()
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr


def test_a_successful_run_leaves_the_temporary_folder_as_it_found_it(tutorial_run):
    assert tutorial_run["proc"].returncode == 0
    assert sorted(p.name for p in tutorial_run["temp"].iterdir()) == []


HANG_AT_EXIT = """\
import atexit, ctypes, os, sys, time
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
sys.stdout.write(f"rank {dist.get_rank()} finished\\n")
dist.destroy_process_group()
if os.environ["RANK"] == "0":
    def slow_but_moving():  # computes for 5 s at exit (a last checkpoint being pickled): busy, not hung
        end = time.monotonic() + 5
        while time.monotonic() < end:
            sum(range(10000))
        open(sys.argv[1], "w").write("rank 0 left")
    atexit.register(slow_but_moving)
else:
    def stuck_at_exit():  # holds the GIL, as the deadlock seen in gloo's teardown did: no Python handler runs
        libc = ctypes.PyDLL(None)
        while True:
            libc.pause()
    atexit.register(stuck_at_exit)
"""


def test_a_worker_that_does_not_exit_is_named_its_stacks_kept_and_it_is_ended(
    tmp_path, no_leftovers
):
    """A rank that finished its script and then hangs holding the GIL (no multigpu import): once it has not
    moved for --exit-timeout the launcher names it and where it is stuck, keeps its threads' stacks, ends it,
    and exits 125 - while a rank whose exit computes for longer than that is left to finish; with restarts
    left the finished script does not run again. The --log-dir holds an earlier launch's records of a later
    attempt: they are cleared, not read."""
    script = tmp_path / "hang_at_exit.py"
    script.write_text(HANG_AT_EXIT)
    logs = tmp_path / "logs"
    logs.mkdir()
    for rank in (0, 1):
        (logs / f"rank{rank}.attempt3.pid").write_text(str(os.getpid()))
    started = time.monotonic()
    proc = multigpu(
        "run",
        "--nproc",
        "2",
        "--exit-timeout",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        str(logs),
        str(script),
        str(tmp_path / "left"),
        no_leftovers,
        timeout=120,
    )
    assert proc.returncode == EXIT_STUCK_AT_EXIT, proc.stderr
    assert time.monotonic() - started < 100
    # no restart
    assert sorted(proc.stdout.split("\n")[:-1]) == ["rank 0 finished", "rank 1 finished"], (
        proc.stdout
    )
    assert (tmp_path / "left").read_text() == "rank 0 left"  # its 5 s exit was not cut short
    errors = [line for line in proc.stderr.splitlines() if line.startswith("multigpu: error:")]
    assert (
        len(errors) == 1 and "rank 1 (pid" in errors[0] and "not moved for 2 s after" in errors[0]
    ), proc.stderr
    assert (
        'hang_at_exit.py", line 19 in stuck_at_exit' in errors[0]
        and "HINT: its script's work is done" in errors[0]
    )
    stacks = Path(re.search(r"Python stacks: (\S+)", errors[0]).group(1))
    assert stacks == logs / "rank1.attempt0.stacks" and "in stuck_at_exit" in stacks.read_text()
    assert f"kept in {logs}" in proc.stderr
    assert not (logs / "rank0.attempt0.stacks").exists()  # rank 0 left normally: no empty file
    # the finished script did not run again; the old records went
    assert not list(logs.glob("*.attempt[13].*"))


def test_the_exit_watch_ends_only_a_worker_that_has_stopped_moving_after_every_rank_finished(
    tmp_path,
):
    """The watch asked at chosen times, with the workers' progress given: a rank that has finished while
    another still trains is waiting; after every rank finished, a worker that reads, writes or computes is
    busy (its last asynchronous checkpoint); one that has not moved for the timeout is ended - through a
    pidfd, its stacks asked for first - and counted as a success only if its script succeeded."""
    from multigpu.launch import exit_watch
    from multigpu.launch.attempts import clear_records, record_path

    # children of ours, alive
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        log = str(tmp_path)
        # an earlier launch's records in a reused --log-dir
        record_path(log, 0, 5, "pid").write_text("1")
        clear_records(log)
        assert list(tmp_path.iterdir()) == []
        for rank, proc in enumerate((busy, idle)):
            record_path(log, rank, 0, "pid").write_text(str(proc.pid))
        seen = {busy.pid: [0.0, 0], idle.pid: [0.0, 0]}
        watch = exit_watch.ExitWatch(log, nproc=2, timeout_s=10)
        look = lambda now: watch.check(now, progress=lambda pid: tuple(seen[pid]))  # noqa: E731
        record_path(log, 1, 0, "exit").write_text("1")
        look(0.0)
        look(100.0)  # rank 0 is still in its script: no clock
        assert watch.ended == []
        record_path(log, 0, 0, "exit").write_text("0")
        look(200.0)  # every rank has finished: the clock starts
        for now in (203.0, 206.0, 209.0, 212.0, 215.0):
            seen[busy.pid][1] += 4096  # rank 0 writes (its last checkpoint); rank 1 does not move
            # a watchdog thread's few milliseconds a second are not progress
            seen[idle.pid][0] += 0.05
            look(now)
        # rank 1 has not moved for 15 s, but rank 0 is still writing: nobody is ended
        assert watch.ended == []
        # three seconds of CPU in the next three: still moving (pickling a state)
        seen[busy.pid][0] += 3.0
        look(218.0)
        assert watch.ended == []
        busy.kill()  # rank 0 is done and gone
        busy.wait()
        look(219.0)
        assert [e.rank for e in watch.ended] == [1]  # the only one left, stalled since 200
        # the stacks signal first (with no faulthandler on it, its default action already ends it), then SIGKILL
        assert idle.wait(timeout=10) in (-exit_watch.STACKS_SIGNAL, -signal.SIGKILL)
        # a failure stays one
        assert watch.ended[0].status == 1 and idle.pid not in exit_watch._ended_succeeded
    finally:
        for proc in (busy, idle):
            proc.kill()
            proc.wait()


WORKER_PROBE = """import concurrent.futures, json, os, pickle, sys, threading, time
import test  # the user's own file named like a module of Python's: theirs to import

def later(name):
    time.sleep(0.5)
    open(name, "w").write("written")

threading.Thread(target=later, args=("from-a-thread.txt",)).start()  # not a daemon: joined at exit, as python does
concurrent.futures.ThreadPoolExecutor(1).submit(later, "from-a-pool.txt")
# a pickle of one of the user's classes, read by a pure-Python unpickler (as torch.load's is)
assert pickle._Unpickler(open("obj.pkl", "rb")).load().value == 3
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked child leaving through the wrapper: not this rank's end
os.waitpid(pid, 0)
logs = json.loads(os.environ["MULTIGPU_JOB"])["workers"]["log_dir"]
print("exit record before the end:", os.path.exists(os.path.join(logs, "rank0.attempt0.exit")))
if len(sys.argv) > 1:
    import tempfile  # imports random: a random.pyc beside this script would hide Python's
"""


def test_the_worker_runs_a_script_as_python_would(tmp_path):
    """The worker wrapper alone (no launcher, no torch): threads are joined before it leaves, a forked
    child does not end the rank, the user's own file named like a module of Python's is theirs, and an
    unpickler may load their class; a sourceless random.pyc beside the script is one line naming it."""
    import py_compile

    (tmp_path / "probe.py").write_text(WORKER_PROBE)
    (tmp_path / "test.py").write_text(
        "class Thing:\n    def __init__(self):\n        self.value = 3\n"
    )
    subprocess.run(
        [PY, "-c", "import pickle, test; pickle.dump(test.Thing(), open('obj.pkl', 'wb'))"],
        cwd=tmp_path,
        check=True,
        env={**child_env(), "PYTHONPATH": str(tmp_path)},
    )
    logs = tmp_path / "logs"
    env = {
        **child_env(),
        "MULTIGPU_JOB": json.dumps({"workers": {"log_dir": str(logs)}}),
        "RANK": "0",
    }
    run = subprocess.run(
        [*python_module("multigpu.launch.worker"), "probe.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "exit record before the end: False" in run.stdout
    assert (
        (tmp_path / "from-a-thread.txt").read_text()
        == (tmp_path / "from-a-pool.txt").read_text()
        == "written"
    )
    assert (logs / "rank0.attempt0.exit").read_text() == "0" and not (
        logs / "rank0.attempt0.stacks"
    ).exists()
    (tmp_path / "random.py").write_text(PLANT.format(name="random.pyc"))
    py_compile.compile(str(tmp_path / "random.py"), cfile=str(tmp_path / "random.pyc"))
    (tmp_path / "random.py").unlink()
    hidden = subprocess.run(
        [*python_module("multigpu.launch.worker"), "probe.py", "x"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    lines = [line for line in hidden.stderr.splitlines() if line.startswith("multigpu: error:")]
    assert hidden.returncode == 1 and len(lines) == 1, hidden.stderr
    assert "random.pyc beside probe.py hides the module 'random' that tempfile imports" in lines[0]
    assert "PLANTED" not in hidden.stderr and "Traceback" not in hidden.stderr


@pytest.mark.soak
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("launcher", ["multigpu run", "torchrun"])
def test_the_tutorials_program_never_hangs_at_exit(tmp_path, launcher):
    """SOAK_LAUNCHES launches in a row of the tutorial's program, each bounded: 0 hangs, 0 failures."""
    launches = int(os.environ.get("SOAK_LAUNCHES", "30"))
    folder = tmp_path / "ddp-tutorial-series"
    shutil.copytree(TUTORIAL, folder)
    command = (
        [*python_module("multigpu"), "run", "--nproc", "2"]
        if launcher == "multigpu run"
        else [*python_module("torch.distributed.run"), "--nproc_per_node", "2"]
    )
    hung, failed, seconds = [], [], []
    for index in range(launches):
        (folder / "snapshot.pt").unlink(missing_ok=True)
        started = time.monotonic()
        try:
            proc = subprocess.run(
                [*command, "multigpu_torchrun.py", "3", "1"],
                capture_output=True,
                text=True,
                cwd=folder,
                env=child_env(),
                timeout=120,
            )
        except subprocess.TimeoutExpired:
            hung.append(index)
            continue
        seconds.append(time.monotonic() - started)
        if proc.returncode != 0:
            failed.append((index, proc.returncode, proc.stderr[-300:]))
    print(
        f"{launcher}: {launches} launches, {len(hung)} hung, {len(failed)} failed, "
        f"median {sorted(seconds)[len(seconds) // 2] if seconds else 0:.2f} s"
    )
    assert hung == [] and failed == []
