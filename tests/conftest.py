"""Shared helpers for tests that start real processes: run the CLI, find leftover processes."""

from __future__ import annotations

import atexit
import contextlib
import getpass
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional

import pytest

# One CPU thread for torch in this process too (before any test module imports torch), as child_env gives
# the processes the tests start: results computed here do not depend on how many cores the machine has,
# and a test's own thread pool does not compete with the processes it launches on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch's inductor sets its cache folder in this process's environment the first time a test uses it (for its
# compile workers), so launches after that inherited it and launches before did not: set from the start, to
# torch's own default, every launch gets the same environment (and the launch server's, see LaunchServer).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())))

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
PY = sys.executable


@pytest.fixture(autouse=True)
def _cpu_tier_sees_no_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests not marked ``gpu`` test CPU behaviour on every machine: on a GPU machine the processes they
    launch would otherwise pick the GPUs (``--nproc 2`` on a one-GPU machine is an error there)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def child_env(extra: Optional[dict] = None, base: Optional[dict] = None) -> dict:
    """A clean environment for launched processes: no stray launcher variables from the outer shell.
    ``base``: the environment to start from (this process's now, by default)."""
    source = os.environ if base is None else base
    # Set in this process by in-process loggers of earlier tests: MLFLOW_ALLOW_FILE_STORE (MLflow's file
    # store), WANDB_SERVICE (the address of this process's W&B service, for its own children).
    env = {k: v for k, v in source.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                          "MASTER_ADDR", "MASTER_PORT",
                                                                          "MLFLOW_ALLOW_FILE_STORE",
                                                                          "WANDB_SERVICE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), str(SCRIPTS), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    if "SLURM_CONF" not in env:  # not the test cluster: Slurm's tools answer "no cluster" (see fakebin/)
        # after a test's own stand-ins (a PATH it gave), before the machine's
        inherited, fakebin = source.get("PATH", ""), str(REPO / "tests" / "fakebin")
        path = env.get("PATH", "")
        env["PATH"] = (path[:-len(inherited)] + os.pathsep.join([fakebin, inherited]) if inherited and path.endswith(inherited)
                       else os.pathsep.join([fakebin, path]))
    return env


class LaunchServer:
    """``python -m multigpu ARGS`` forked from one interpreter that imported torch (and torch._dynamo, and
    matplotlib's figure for the Trainer's curves.png) once per test process: tests/scripts/case_server.py
    ``--launches``. Why: a 2-process launch spent ~7 s of CPU importing torch in the launcher and
    torch._dynamo in its fork server, ~5 s more than the work of most tests' launches, and the suite launches
    a few hundred times. The launcher, torch's agent, the boot processes, the fork server and the workers run
    as in a user's launch; the launcher is a fork of a process that imported torch with the launch's
    environment (one that differs starts a new interpreter, and a launch that adds a variable torch reads at
    import, ``--debug``'s, starts its workers the plain way). The new-interpreter path stays tested where it
    is the point: every command of the docs pages, test_launch_real.py (but its shutdown test, about the
    workers' exit, and its test of this server), test_forkserver.py, the hostile tables' ``run`` cases, tests
    that Popen a launcher.
    A process a launch leaves behind fails the call (the server is the launches' subreaper). A call that is
    interrupted (a test's timeout, Ctrl-C) stops the server and what it runs; the next call starts another.
    What else differs from a new interpreter: every launch of one test process has the server's string-hash
    seed (a user's launches each draw one; the new-interpreter tests below keep that case), and a forked
    process is found by its parent, not by a test's token on its command line (the boot processes keep it).
    ``MGTEST_FRESH=1``: every launch a new interpreter (for comparisons); ``MGTEST_LAUNCH_LOG=FILE``: a line
    per launch through the server, with the variables that made it start a new interpreter."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.folder = Path(tempfile.mkdtemp(prefix="mgtest-launches-"))
        self.lock = threading.Lock()
        self.count = 0
        self.proc = subprocess.Popen([PY, str(SCRIPTS / "case_server.py"), "--launches"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=child_env(base=_ENV_AT_START),
                                     cwd=str(REPO))

    def run(self, args: tuple, env: dict, cwd: Path, timeout: float) -> Optional[subprocess.CompletedProcess]:
        """The command's result, or None where the server is busy (a test's second thread) or gone."""
        if os.getpid() != self.owner or self.proc.poll() is not None or not self.lock.acquire(blocking=False):
            return None
        try:
            self.count += 1
            out, err = self.folder / "stdout", self.folder / "stderr"
            request = {"id": self.count, "argv": list(args), "cwd": str(cwd), "env": env, "out": str(out),
                       "err": str(err), "timeout": timeout, "launch": True}
            assert self.proc.stdin is not None and self.proc.stdout is not None
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                line = self.proc.stdout.readline()
            except BaseException:  # a test's timeout or Ctrl-C: this launch must end with it, as a child would
                self.close()
                _launch_server.clear()
                raise
            if not line:
                raise AssertionError("the launch server died")
            reply = json.loads(line)
            assert reply["id"] == self.count, reply
            argv = [PY, "-m", "multigpu", *args]
            if os.environ.get("MGTEST_LAUNCH_LOG"):  # which launches started a new interpreter, and why
                with open(os.environ["MGTEST_LAUNCH_LOG"], "a") as log:
                    log.write(f"{os.environ.get('PYTEST_CURRENT_TEST')}\t{reply['new_interpreter_for']}\t{args[:1]}\n")
            if reply["status"] == -9:
                raise subprocess.TimeoutExpired(argv, timeout)
            assert not reply["left"], f"processes left behind by multigpu {' '.join(args)}: {reply['left']}"
            return subprocess.CompletedProcess(argv, reply["status"], out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))
        finally:
            self.lock.release()

    def close(self) -> None:
        """Stop the server: it kills what it started (SIGTERM; SIGKILL if it does not end in 20 s)."""
        if os.getpid() != self.owner:  # a test's fork of this process exiting: the server is not its own
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_ENV_AT_START = dict(os.environ)  # before any test changed it: the launch server's environment
_launch_server: list[LaunchServer] = []  # one per test process, started by the first launch (again after a stop)
_launch_server_lock = threading.Lock()


def _server() -> LaunchServer:
    with _launch_server_lock:
        if not _launch_server:
            _launch_server.append(LaunchServer())
            atexit.register(_launch_server[0].close)
        return _launch_server[0]


def multigpu(*args: str, timeout: float = 120, env: Optional[dict] = None, cwd: Optional[Path] = None,
             check: bool = False, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m multigpu ARGS`` to completion and capture its output: forked from the launch server
    (:class:`LaunchServer`), or with ``fresh`` in a new interpreter, as from a shell."""
    fresh = fresh or bool(os.environ.get("MGTEST_FRESH"))
    proc = None if fresh else _server().run(args, child_env(env), cwd or REPO, timeout)
    if proc is None:
        proc = subprocess.run([PY, "-m", "multigpu", *args], capture_output=True, text=True, timeout=timeout,
                              env=child_env(env), cwd=str(cwd or REPO))
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def multigpu_here(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    """``multigpu ARGS`` in this process (``multigpu.cli.main``), for commands whose result a test reads
    rather than their process: a new interpreter and ``import torch`` cost ~4 s of CPU each. The
    commands' own processes are tested where that is the point (the hostile-input tables)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from multigpu.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's refusals and --help end this way
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    proc = subprocess.CompletedProcess(["multigpu", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"exit {code}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def processes_with(token: str) -> list[int]:
    """Pids whose command line contains ``token`` (a unique marker passed to the processes under test)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def wait_until_gone(token: str, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = processes_with(token)
        if not left:
            return []
        time.sleep(0.2)
    return processes_with(token)


def kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def leftovers_checked() -> Iterator[str]:
    """Yields a unique token to pass to the processes started inside; afterwards no process carrying it may
    remain (they are killed if so). For a module fixture's shared launch; tests use ``no_leftovers``."""
    token = f"mgtest-{os.getpid()}-{time.monotonic_ns()}"
    try:
        yield token
    finally:
        left = wait_until_gone(token, timeout=15)
        kill_all(left)
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def no_leftovers():
    """Yields a unique token; after the test, no process carrying it may remain (they are killed if so)."""
    with leftovers_checked() as token:
        yield token


def wait_for_files(folder: Path, names: Iterable[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    names = list(names)
    while time.monotonic() < deadline:
        if all((folder / n).exists() for n in names):
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {names} in {folder}")



def listening(port: int) -> bool:
    """Some process here listens on ``port`` (IPv4 or IPv6), from /proc/net: a connection of our own would
    be a client to the store that listens."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            fields = [row.split() for row in list(rows)[1:]]
            if any(f[1].endswith(f":{port:04X}") and f[3] == "0A" for f in fields):  # 0A: LISTEN
                return True
    return False
