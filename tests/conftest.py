"""Shared helpers for tests that start real processes: run the CLI, find leftover processes."""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import pytest

from multigpu.launch.interpreter import python_module

# One CPU thread for torch in this process too (before any test module imports torch), as child_env gives
# the processes the tests start: results computed here do not depend on how many cores the machine has,
# and a test's own thread pool does not compete with the processes it launches on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch's inductor sets its cache folder in this process's environment the first time a test uses it (for its
# compile workers), so launches after that inherited it and launches before did not: set from the start, to
# torch's own default, every launch gets the same environment.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    ),
)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
PY = sys.executable


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak", action="store_true", help="run the soak tier: many launches in a row (make soak)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """The soak tier (``@pytest.mark.soak``) runs only with --soak: it is a measurement of many launches, by
    hand or by .ci/stability, too long for every ``make test``."""
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak tier: run with make soak (pytest --soak)")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


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
    env = {
        k: v
        for k, v in source.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_"))
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "MLFLOW_ALLOW_FILE_STORE",
            "WANDB_SERVICE",
        )
    }
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO / "src"), str(SCRIPTS), env.get("PYTHONPATH")])
    )
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    # not the test cluster: Slurm's tools answer "no cluster" (see fakebin/)
    if "SLURM_CONF" not in env:
        # after a test's own stand-ins (a PATH it gave), before the machine's
        inherited, fakebin = source.get("PATH", ""), str(REPO / "tests" / "fakebin")
        path = env.get("PATH", "")
        env["PATH"] = (
            path[: -len(inherited)] + os.pathsep.join([fakebin, inherited])
            if inherited and path.endswith(inherited)
            else os.pathsep.join([fakebin, path])
        )
    return env


def shared_output(
    factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """A folder that ``build(folder)`` fills once per test session, for every test file and pytest-xdist
    worker that asks for ``name``: a launch whose output several files compare against (the fault tests'
    uninterrupted reference). The first to ask builds it under a lock; the others wait and read it."""
    import fcntl

    base = factory.getbasetemp()
    root = (base.parent if base.name.startswith("popen-gw") else base) / "shared"
    root.mkdir(exist_ok=True)
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"{name}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (root / f"{name}.done").write_text("")
    return folder


def multigpu(
    *args: str,
    timeout: float = 120,
    env: Optional[dict] = None,
    cwd: Optional[Path] = None,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``multigpu ARGS`` to completion in a new interpreter, as a shell would (``python -P -m multigpu``:
    the current folder is not on ``sys.path``, as under the ``multigpu`` command), and capture its output."""
    proc = subprocess.run(
        [*python_module("multigpu"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        cwd=str(cwd or REPO),
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
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
