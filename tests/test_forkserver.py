"""Workers forked from the launcher's fork server (multigpu.launch.forkserver) start as fresh as the plain
start: own session, signal handlers, environment, folder, random state; the boot process the agent
watches leaves with the worker's status or signal; a killed boot process takes its worker with it; a
malformed or foreign request never stops the server; anything it cannot fork for starts the plain way."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PY, child_env, multigpu, processes_with, wait_for_files

from multigpu.launch.boot import HEADER, frame
from multigpu.launch.forkserver import ForkServer, declines

# Each test launches one 2-process run or one fork server (torch imported once, ~5 s of CPU; up to ~40 s
# on two busy cores); a hang ends here.
pytestmark = pytest.mark.timeout(180)

PROBE = """\
import json, os, random, signal, sys
import numpy, torch
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
print(json.dumps({"rank": os.environ.get("RANK"), "parent": parent, "argv": sys.argv, "cwd": os.getcwd(),
                  "path0": sys.path[0], "umask": os.umask(0o022), "session": os.getsid(0) == os.getpid(),
                  "random": random.random(), "numpy": float(numpy.random.rand()), "torch": torch.rand(1).item(),
                  "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                  "sigpipe": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
                  "mine": os.environ.get("PROBE_VALUE")}), flush=True)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def _records(stdout: str) -> list[dict]:
    return sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    script = tmp_path_factory.mktemp("probe") / "probe.py"
    script.write_text(PROBE)
    return script


def test_forked_workers_start_like_fresh_interpreters(probe, tmp_path, no_leftovers):
    proc = subprocess.run([PY, "-m", "multigpu", "run", "--nproc", "2", str(probe), "0", no_leftovers],
                          capture_output=True, text=True, timeout=150, cwd=tmp_path,
                          env=child_env({"PROBE_VALUE": "seen"}), preexec_fn=lambda: os.umask(0o027))
    assert proc.returncode == 0, proc.stderr
    records = _records(proc.stdout)
    assert [r["rank"] for r in records] == ["0", "1"]
    for r in records:
        assert "multigpu.launch.forkserver" in r["parent"], r["parent"]
        assert r["argv"] == [str(probe), "0", no_leftovers] and r["path0"] == str(probe.parent)
        assert r["cwd"] == str(tmp_path) and r["umask"] == 0o027 and r["mine"] == "seen"
        assert r["session"] and r["sigint"] and r["sigterm"] and r["sigpipe"]
    for generator in ("random", "numpy", "torch"):  # each seeded from the OS, as in a new process
        assert records[0][generator] != records[1][generator]


def test_plain_start_when_asked(probe, no_leftovers):
    proc = multigpu("run", "--nproc", "2", str(probe), "0", no_leftovers,
                    env={"MULTIGPU_WORKER_START": "plain"}, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert all("multigpu.launch.forkserver" not in r["parent"] for r in _records(proc.stdout))


def test_killing_a_boot_process_kills_its_worker(tmp_path, no_leftovers):
    script = tmp_path / "hold.py"
    script.write_text("import os, sys, time\nimport multigpu as mg\nrun = mg.init(timeout_s=60)\n"
                      f"tmp = os.path.join({str(tmp_path)!r}, f'pid{{run.rank}}')\n"
                      "open(tmp, 'w').write(str(os.getpid()))\n"
                      f"os.replace(tmp, os.path.join({str(tmp_path)!r}, f'held{{run.rank}}'))\n"
                      "time.sleep(120)\n")
    launcher = subprocess.Popen([PY, "-m", "multigpu", "run", "--nproc", "2", str(script), no_leftovers],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    wait_for_files(tmp_path, ["held0", "held1"], timeout=120)
    worker = int((tmp_path / "held1").read_text())
    boots = [pid for pid in processes_with(no_leftovers) if b"multigpu.launch.boot" in
             Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(boots) == 2 and worker not in boots
    rank1 = next(pid for pid in boots if b"RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes())
    os.kill(rank1, signal.SIGKILL)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode != 0
    assert "rank 1" in err and "SIGKILL" in err, err
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split(")")[1][:3]


@pytest.fixture(scope="module")
def server():
    found = ForkServer.start(["probe"])
    assert found is not None
    yield found
    found.stop()
    assert not Path(found.folder).exists()


def _server_env(server: ForkServer) -> dict:
    """The server's own environment (pytest changes PYTEST_CURRENT_TEST in ours after every test)."""
    raw = Path(f"/proc/{server.process.pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def _boot(server: ForkServer, probe: Path, *args: str, extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**_server_env(server), **(extra or {})}
    return subprocess.run([PY, "-u", "-m", "multigpu.launch.boot", str(probe), *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_the_boot_process_leaves_with_the_workers_status(server, probe):
    proc = _boot(server, probe, "5")
    assert proc.returncode == 5, proc.stderr
    assert "multigpu.launch.forkserver" in json.loads(proc.stdout)["parent"]


def test_the_boot_process_dies_by_the_workers_signal(server, tmp_path):
    script = tmp_path / "segv.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert _boot(server, script).returncode == -signal.SIGSEGV


def test_a_signal_to_the_boot_process_reaches_the_worker(server, tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(42))\n"
                      "print('ready', flush=True)\ntime.sleep(60)\nsys.exit(1)\n")
    env = _server_env(server)
    boot = subprocess.Popen([PY, "-u", "-m", "multigpu.launch.boot", str(script)], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert boot.stdout is not None and boot.stdout.readline().strip() == "ready"
    boot.send_signal(signal.SIGTERM)
    assert boot.wait(timeout=30) == 42


def test_a_different_environment_starts_the_plain_way(server, probe):
    proc = _boot(server, probe, "4", extra={"OMP_NUM_THREADS": "7"})
    assert proc.returncode == 4, proc.stderr
    assert "multigpu.launch.forkserver" not in json.loads(proc.stdout)["parent"]


def test_malformed_requests_do_not_stop_the_server(server, probe):
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(20)
        sock.connect(server.path)
        return sock

    attempts = [
        lambda s: s.sendall(b"not a frame at all"),  # no descriptors
        lambda s: socket.send_fds(s, [HEADER.pack(1 << 40)], [0, 1, 2]),  # a length past the limit
        lambda s: socket.send_fds(s, [frame({"argv": "x"})], [0, 1, 2]),  # wrong types
        lambda s: socket.send_fds(s, [frame({"argv": [], "env": {"A\0": "b"}, "cwd": "/", "path": [],
                                             "umask": 0})], [0, 1, 2]),
        lambda s: socket.send_fds(s, [HEADER.pack(100) + b"{"], [0, 1, 2]),  # then silence: closed by timeout
        lambda s: socket.send_fds(s, [frame({"argv": [], "env": {}, "cwd": "/", "path": [], "umask": 0})],
                                  [0]),  # one descriptor, not three
    ]
    for attempt in attempts:
        with connect() as sock:
            attempt(sock)
            sock.shutdown(socket.SHUT_WR)
            try:  # refused and closed (reset when our bytes were left unread); nothing forked
                assert sock.recv(4096) == b""
            except ConnectionResetError:
                pass
    assert _boot(server, probe, "3").returncode == 3
    assert server.process.poll() is None


def test_another_user_cannot_reach_the_server(server):
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    code = ("import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({server.path!r})\nexcept PermissionError:\n    sys.exit(0)\nsys.exit(1)\n")
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0


def test_what_may_differ_between_the_server_and_a_worker():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "TORCHELASTIC_RUN_ID": "a"}
    assert declines(base, {**base, "RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "b",
                           "TORCHELASTIC_ERROR_FILE": "/x", "MASTER_PORT": "1"}) is None
    assert "OMP_NUM_THREADS" in (declines(base, {**base, "OMP_NUM_THREADS": "1"}) or "")
    assert "TORCH_LOGS" in (declines(base, {**base, "TORCH_LOGS": "+dynamo"}) or "")
    assert "PATH" in (declines(base, {"OMP_NUM_THREADS": "2"}) or "")
