"""Workers forked from the launcher's fork server (multigpu.launch.forkserver) start as fresh as the plain
start: own session, signal handlers, environment, folder, random state; the boot process the agent
watches leaves with the worker's status or signal; a killed boot process takes its worker with it; a
malformed or foreign request never stops the server; anything it cannot fork for starts the plain way."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import PY, SCRIPTS, child_env, multigpu as _multigpu, processes_with, wait_for_files, wait_until_gone

from multigpu.launch.forkserver import declines

# Each test launches one 2-process run or one fork server (torch imported once, ~5 s of CPU; up to ~40 s
# on two busy cores); a hang ends here.
pytestmark = pytest.mark.timeout(180)
# The fork server as a user's launch starts it: each launch a new interpreter (not the suite's launch server).
multigpu = functools.partial(_multigpu, fresh=True)

PROBE = """\
import json, multiprocessing, os, random, signal, sys
import numpy, torch
parent = open(f"/proc/{os.getppid()}/comm").read().strip()  # the server names itself multigpu-fork


# One write per record (print writes the text and the newline apart: two ranks' lines could interleave).
sys.stdout.write(json.dumps({"rank": os.environ.get("RANK"), "parent": parent, "argv": sys.argv, "cwd": os.getcwd(),
                  "path0": sys.path[0], "umask": os.umask(0o022), "session": os.getsid(0) == os.getpid(),
                  "random": random.random(), "numpy": float(numpy.random.rand()), "torch": torch.rand(1).item(),
                  "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                  "sigpipe": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
                  "authkey": multiprocessing.current_process().authkey.hex(),
                  "mine": os.environ.get("PROBE_VALUE"), "safe_path": sys.flags.safe_path,
                  "stdin": None if sys.stdin is None else "open",
                  "fd0": os.path.exists("/proc/self/fd/0")}) + "\\n")
sys.stdout.flush()
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
    """Started with stdin closed, from a folder holding a profile.py (which torch._dynamo's import would
    run if the server had the launcher's folder on sys.path)."""
    (tmp_path / "profile.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")

    def closed_stdin_and_umask() -> None:
        os.close(0)
        os.umask(0o027)

    proc = subprocess.run([PY, "-m", "multigpu", "run", "--nproc", "2", str(probe), "0", no_leftovers],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=150, cwd=tmp_path,
                          env=child_env({"PROBE_VALUE": "seen"}), preexec_fn=closed_stdin_and_umask)
    assert proc.returncode == 0, proc.stderr
    records = _records(proc.stdout)
    assert [r["rank"] for r in records] == ["0", "1"]
    for r in records:
        assert r["parent"] == "multigpu-fork", r["parent"]
        assert r["argv"] == [str(probe), "0", no_leftovers] and r["path0"] == str(probe.parent)
        assert r["cwd"] == str(tmp_path) and r["umask"] == 0o027 and r["mine"] == "seen"
        assert r["session"] and r["sigint"] and r["sigterm"] and r["sigpipe"]
        assert r["stdin"] is None and not r["fd0"] and not r["safe_path"]  # stdin closed, as in the launcher
    for generator in ("random", "numpy", "torch", "authkey"):  # each drawn from the OS, as in a new process
        assert records[0][generator] != records[1][generator]
    assert not (tmp_path / "ran").exists()
    assert "Traceback" not in proc.stderr


def test_a_closed_stdout_stays_closed(tmp_path, no_leftovers):
    """Launched with stdout closed: what the script prints goes nowhere (a new interpreter has
    sys.stdout None), never to the server as a request to signal the worker."""
    script = tmp_path / "say.py"
    script.write_text("import os, sys\nimport multigpu as mg\nrun = mg.init(timeout_s=60)\n"
                      "print('{\"signal\": 15}')\n"
                      f"open(os.path.join({str(tmp_path)!r}, f'out{{run.rank}}'), 'w').write(repr(sys.stdout))\n")
    proc = subprocess.run([PY, "-m", "multigpu", "run", "--nproc", "2", str(script), no_leftovers],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=150,
                          env=child_env(), preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0, proc.stderr
    assert [(tmp_path / f"out{r}").read_text() for r in (0, 1)] == ["None", "None"]
    assert "Traceback" not in proc.stderr


def test_plain_start_when_asked(probe, no_leftovers):
    proc = multigpu("run", "--nproc", "2", str(probe), "0", no_leftovers,
                    env={"MULTIGPU_WORKER_START": "plain"}, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert all(r["parent"] != "multigpu-fork" for r in _records(proc.stdout))


@pytest.mark.parametrize("target", ["boot", "worker"])
def test_a_rank_killed_by_sigkill_is_reported_so(target, tmp_path, no_leftovers):
    """SIGKILL of the boot process (its worker goes too) or of the forked worker (the boot process dies by
    the same signal): the launcher names the rank, the signal and the worker's pid, and leaves with 137."""
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
    os.kill(rank1 if target == "boot" else worker, signal.SIGKILL)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 128 + signal.SIGKILL, err
    assert f"rank 1 (local rank 1, pid {worker}) was killed by SIGKILL" in err, err
    assert "Traceback" not in err
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split(")")[1][:3]


@pytest.fixture
def temp() -> Iterator[Path]:
    """A TMPDIR short enough for the server's socket (pytest-xdist's tmp_path is not)."""
    folder = Path(tempfile.mkdtemp(prefix="mgt-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_stopped_while_starting_leaves_no_folders(tmp_path, temp, no_leftovers):
    """SIGTERM while the launcher forks its server: status 143, and neither the log folder nor the server's."""
    launcher = subprocess.Popen([PY, "-m", "multigpu", "run", "--nproc", "2", str(tmp_path / "never.py"),
                                 no_leftovers], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=child_env({"TMPDIR": str(temp)}))
    (tmp_path / "never.py").write_text("raise SystemExit(5)\n")
    deadline = time.monotonic() + 60
    while not list(temp.glob("multigpu-fork-*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode in (143, 5), err  # 5: the workers had already run (a very fast machine)
    if launcher.returncode == 143:
        assert "while starting" in err or "stopped by SIGTERM" in err, err
    assert "Traceback" not in err
    assert [p.name for p in temp.iterdir() if p.name.startswith("multigpu-")] == []


STOP_IN_START = """\
import os, signal, sys, tempfile
from multigpu.launch import forkserver
from multigpu.launch.forkserver import ForkServer
from multigpu.launch.process import StopSignals, Stopped, agent_signal_handlers, install_stops, restore_stops

where, threads = sys.argv[1], sys.argv[2]
if threads == "numpy":  # OpenBLAS starts a thread Python's threading does not see; the signal may go to it
    import numpy
    assert len(os.listdir("/proc/self/task")) > 1
if where == "folder":  # the signal comes the moment the server's folder exists
    real = tempfile.mkdtemp
    def mkdtemp(*args, **kwargs):
        folder = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return folder
    forkserver.tempfile.mkdtemp = mkdtemp
else:  # the moment the server has been forked, before the caller holds it
    fork = ForkServer._fork.__func__
    def forked(cls, *args):
        server = fork(cls, *args)
        os.kill(os.getpid(), signal.SIGTERM)
        return server
    ForkServer._fork = classmethod(forked)
kept = []
stops, saved = StopSignals(), agent_signal_handlers()
try:  # as the launcher starts
    install_stops(stops, saved)
    with stops.held():
        ForkServer.start(kept.append, dynamo=False)
    print("not stopped", flush=True)
except Stopped as stopped:
    print("stopped by", signal.Signals(stopped.signum).name, "kept", len(kept), flush=True)
finally:
    restore_stops(stops, saved)
for server in kept:
    server.stop()
    print("server gone", not os.path.exists(f"/proc/{server.pid}"), flush=True)
print("handler back", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
"""


@pytest.mark.parametrize("threads", ["one", "numpy"])
@pytest.mark.parametrize("where", ["folder", "forked"])
def test_a_stop_signal_while_the_server_starts_waits_until_the_launcher_holds_it(temp, where, threads):
    """The signal is sent at the moment named (not a race a busy machine may or may not hit): held as the
    launcher holds it, it raises once the server is held, whose stop() then leaves neither a process nor a
    folder - also where a library's thread (numpy's OpenBLAS, as torch's) is there to take the signal."""
    done = subprocess.run([PY, "-c", STOP_IN_START, where, threads], capture_output=True, text=True, timeout=120,
                          env=child_env({"TMPDIR": str(temp), "OPENBLAS_NUM_THREADS": "2"}))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["stopped by SIGTERM kept 1", "server gone True", "handler back True"], \
        done.stdout + done.stderr
    assert list(temp.iterdir()) == []


def test_sigkill_of_the_launcher_removes_the_servers_folder(tmp_path, temp, no_leftovers):
    script = tmp_path / "hold.py"
    script.write_text(f"import os, time\nopen(os.path.join({str(tmp_path)!r}, 'held' + os.environ['RANK']), 'w')"
                      ".close()\ntime.sleep(120)\n")
    launcher = subprocess.Popen([PY, "-m", "multigpu", "run", "--nproc", "2", str(script), no_leftovers],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env({"TMPDIR": str(temp)}))
    wait_for_files(tmp_path, ["held0", "held1"], timeout=120)
    assert list(temp.glob("multigpu-fork-*"))
    launcher.kill()
    launcher.communicate(timeout=30)
    assert wait_until_gone(no_leftovers, timeout=30) == []
    assert list(temp.glob("multigpu-fork-*")) == []


class Launcher:
    """tests/scripts/fork_launcher.py: a new interpreter that starts the fork server and starts the tests' boot
    processes as its children (the server forks only for its launcher's children). Not this process: a
    server forked from pytest, and its workers, would carry pytest's heap, exit handlers and threads."""

    def __init__(self, log: Path) -> None:
        self.log = log  # why a request got the plain start (verbose)
        self.proc = subprocess.Popen([PY, str(SCRIPTS / "fork_launcher.py"), str(log)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=child_env())
        hello = self._answer()
        assert "error" not in hello, hello
        self.pid, self.path, self.folder, self.env = hello["pid"], hello["path"], hello["folder"], hello["env"]

    def _answer(self, command: dict | None = None) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the launcher died"
        return json.loads(line)

    def run(self, argv: list[str], extra: dict | None = None, **options: object) -> subprocess.CompletedProcess:
        """``argv`` started by the launcher, to completion (``signal``/``wait``: see fork_launcher.run)."""
        answer = self._answer({"do": "run", "argv": argv, "env": {**self.env, **(extra or {})}, **options})
        proc = subprocess.CompletedProcess(argv, answer["status"], answer["stdout"], answer["stderr"])
        proc.hung = answer.get("hung")  # type: ignore[attr-defined]
        return proc

    def running(self) -> bool:
        return self._answer({"do": "running"})["running"]

    def stop(self) -> bool:
        """Stop the server; True when its folder is gone."""
        stopped = self._answer({"do": "stop"})["stopped"]
        self.proc.wait(timeout=30)
        return stopped


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path_factory.mktemp("server") / "stderr")
    yield launcher
    assert launcher.stop()


def _parent(server: Launcher, proc: subprocess.CompletedProcess) -> str:
    """The command line of the probe's parent; the server's log goes with a failed assertion."""
    assert proc.stdout.strip(), proc.stderr + server.log.read_text()
    return json.loads(proc.stdout)["parent"] + " | server said: " + server.log.read_text()


def _boot(server: Launcher, probe: Path, *args: str, extra: dict | None = None) -> subprocess.CompletedProcess:
    return server.run([PY, "-u", "-m", "multigpu.launch.boot", str(probe), *args], extra)


def test_the_boot_process_leaves_with_the_workers_status(server, probe):
    proc = _boot(server, probe, "5")
    assert proc.returncode == 5, proc.stderr
    parent = _parent(server, proc)
    assert parent.startswith("multigpu-fork |"), parent


def test_the_boot_process_dies_by_the_workers_signal(server, tmp_path):
    script = tmp_path / "segv.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert _boot(server, script).returncode == -signal.SIGSEGV


def test_a_signal_to_the_boot_process_reaches_the_worker(server, tmp_path):
    """The worker leaves at once on SIGTERM; 30 s is for two busy cores. Where it does not, the failure says
    where the worker, the boot process and the server are, with the worker's Python stack."""
    script = tmp_path / "wait.py"
    script.write_text("import faulthandler, os, signal, sys, time\nfaulthandler.register(signal.SIGUSR2)\n"
                      "signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))\n"
                      "print('ready', os.getpid(), flush=True)\ntime.sleep(60)\nsys.exit(1)\n")
    proc = server.run([PY, "-u", "-m", "multigpu.launch.boot", str(script)], signal=int(signal.SIGTERM), wait=30)
    assert proc.stdout.startswith("ready "), proc.stderr
    assert proc.returncode == 42 and not proc.hung, (proc.hung, proc.stderr, server.log.read_text())  # type: ignore[attr-defined]


def test_a_different_environment_starts_the_plain_way(server, probe):
    proc = _boot(server, probe, "4", extra={"OMP_NUM_THREADS": "7"})
    assert proc.returncode == 4, proc.stderr
    assert json.loads(proc.stdout)["parent"] != "multigpu-fork"
    log = server.log.read_text()  # type: ignore[attr-defined]
    assert "starts the plain way: its environment differs in OMP_NUM_THREADS" in log, log


MALFORMED = """\
import json, socket, struct, sys
from multigpu.launch.boot import HEADER, frame
good = {"argv": [], "env": {}, "cwd": "/", "path": [], "umask": 0, "closed": []}
attempts = [
    (b"not a frame at all", 0),                                     # no descriptors
    (HEADER.pack(1 << 40), 3),                                      # a length past the limit
    (frame({"argv": "x"}), 3),                                      # wrong types
    (frame({**good, "env": {"A\\0": "b"}}), 3),                      # a NUL in the environment
    (HEADER.pack(100) + b"{", 3),                                   # then silence: dropped at its deadline
    (frame(good), 1),                                               # one descriptor, not three
    (HEADER.pack(200_001) + b"[" * 200_000 + b"1", 3),             # nested too deep for the parser
    (frame({**good, "closed": [5]}), 3),                            # not a standard descriptor
    (frame({**good, "umask": True}), 3),                            # a bool is not a umask
]
for payload, fds in attempts:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(sys.argv[1])
    try:  # the server may refuse and close before it has read everything: that counts as closed
        if fds:
            sent = socket.send_fds(s, [payload[:HEADER.size]], [0, 1, 2][:fds])
            s.sendall(payload[sent:])
        else:
            s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        answer = s.recv(4096)
    except (BrokenPipeError, ConnectionResetError):
        answer = b""
    print(json.dumps(answer.decode(errors="replace")), flush=True)
"""


def test_malformed_requests_do_not_stop_the_server(server, probe):
    """Sent by a child of the server's launcher (as boot processes are), so they reach the parser."""
    proc = server.run([PY, "-c", MALFORMED, server.path])
    assert proc.returncode == 0, proc.stderr
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    assert answers == [""] * 9  # each refused and closed without an answer: nothing forked, nothing echoed
    assert _boot(server, probe, "3").returncode == 3
    assert server.running()


def test_another_user_cannot_reach_the_server(server):
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    code = ("import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({server.path!r})\nexcept PermissionError:\n    sys.exit(0)\nsys.exit(1)\n")
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0


def test_a_process_the_launcher_did_not_start_is_not_served(server, probe):
    """Only the launcher's children (torch's agent starts the boot processes) are forked for: a grandchild
    - a worker's own subprocess that found the socket in its environment - gets the plain start."""
    code = ("import subprocess, sys\n"
            f"sys.exit(subprocess.run([sys.executable, '-m', 'multigpu.launch.boot', {str(probe)!r}, '6']).returncode)")
    proc = server.run([PY, "-c", code])
    assert proc.returncode == 6, proc.stderr
    assert json.loads(proc.stdout)["parent"] != "multigpu-fork"


def test_a_module_beside_the_script_that_the_server_has_imported_starts_plain(server, tmp_path):
    """A new interpreter would import the user's statistics.py; a forked worker would keep the server's."""
    (tmp_path / "statistics.py").write_text("MINE = True\n")
    script = tmp_path / "uses.py"
    script.write_text("import statistics, sys\nsys.exit(7 if getattr(statistics, 'MINE', False) else 1)\n")
    assert _boot(server, script).returncode == 7


def test_garbage_signal_lines_and_a_vanished_boot_process(server, tmp_path, probe):
    """Lines that are no signal are ignored (the worker they were sent for still runs after them); a boot
    process gone once its worker was forked takes that worker with it."""
    script = tmp_path / "sleep.py"
    script.write_text(f"import os, time\nopen({str(tmp_path / 'pid')!r} + str(os.getpid()), 'w').close()\n"
                      "time.sleep(60)\n")
    code = ("import json, os, socket, sys, time\nfrom multigpu.launch import boot\n"
            "s = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
            "data = boot.frame(boot.request([sys.argv[2]], []))\n"
            "socket.send_fds(s, [data], [0, 1, 2])\n"
            "answer = b''\n"
            "while not answer.endswith(b'\\n'):\n"
            "    answer += s.recv(100)\n"
            "pid = json.loads(answer)['pid']\n"
            "print(pid, flush=True)\n"
            "if sys.argv[3] == 'garbage':\n"
            "    deadline = time.monotonic() + 60\n"
            "    while not os.path.exists(sys.argv[4] + str(pid)) and time.monotonic() < deadline:\n"
            "        time.sleep(0.05)\n"
            "    s.sendall(b'{\"signal\": 1e400}\\n{\"signal\": \"9\"}\\n[1]\\nnot json\\n{\"signal\": 99999}\\n')\n"
            "    time.sleep(1)\n"
            "    state = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]\n"
            "    print('alive' if state not in 'ZX' else 'ended', flush=True)\n")
    pids = []
    for mode, expected in (("garbage", ["alive"]), ("vanish", [])):
        proc = server.run([PY, "-c", code, server.path, str(script), mode, str(tmp_path / "pid")])
        assert proc.returncode == 0, proc.stderr
        first, *rest = proc.stdout.split()
        assert rest == expected, proc.stdout  # the garbage lines ended nothing
        pids.append(int(first))  # a worker was forked for each
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)  # both clients gone: neither worker is left running
    assert (tmp_path / f"pid{pids[0]}").exists()  # the garbage one ran its script
    assert _boot(server, probe, "3").returncode == 3 and server.running()


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
    except OSError:
        return False


def test_what_may_differ_between_the_server_and_a_worker():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "TORCHELASTIC_RUN_ID": "a"}
    assert declines(base, {**base, "RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "b",
                           "TORCHELASTIC_ERROR_FILE": "/x", "MASTER_PORT": "1"}) is None
    assert "OMP_NUM_THREADS" in (declines(base, {**base, "OMP_NUM_THREADS": "1"}) or "")
    assert "TORCH_LOGS" in (declines(base, {**base, "TORCH_LOGS": "+dynamo"}) or "")
    assert "PATH" in (declines(base, {"OMP_NUM_THREADS": "2"}) or "")


READER = """\
import os, sys, torch, torch.distributed as dist
import multigpu as mg
run = mg.init(timeout_s=60)
data = sys.stdin.buffer.read() if run.rank == 0 else b""
sys.stdout.write(repr({"rank": run.rank, "stdin": data, "names": [s.name for s in (sys.stdin, sys.stdout, sys.stderr)],
            "modes": [s.mode for s in (sys.stdin, sys.stdout, sys.stderr)],
            "comm": open("/proc/self/comm").read().strip(), "parent": open(f"/proc/{os.getppid()}/comm").read().strip(),
            "threads": torch.get_num_threads(), "debug": str(dist.get_debug_level()),
            "optimize": sys.flags.optimize}) + "\\n")  # one write: ranks' lines never interleave
sys.stdout.flush()
"""


def test_under_debug_a_forked_worker_has_the_debug_variables_and_python_s_own_streams(tmp_path, no_leftovers):
    """--debug sets variables torch reads when it is imported: the launcher imports torch after setting
    them, so a forked worker has them as a plain one has; its streams are built as Python builds its
    own (bytes read unchanged, names, modes), and it is named as a new interpreter is."""
    script = tmp_path / "reader.py"
    script.write_text(READER)
    proc = subprocess.run([PY, "-m", "multigpu", "run", "--nproc", "2", "--debug", "--log-dir", str(tmp_path / "logs"),
                           str(script), no_leftovers], input=b"a\r\nb\rc\n", capture_output=True, timeout=150,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr.decode()
    import ast

    records = sorted((ast.literal_eval(line) for line in proc.stdout.decode().splitlines() if line.startswith("{")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1]
    assert records[0]["stdin"] == b"a\r\nb\rc\n"
    for r in records:
        assert r["parent"] == "multigpu-fork" and r["comm"] == os.path.basename(PY)[:15]
        assert r["names"] == ["<stdin>", "<stdout>", "<stderr>"] and r["modes"] == ["r", "w", "w"]
        assert r["threads"] == 1 and r["debug"] == "DebugLevel.INFO", r


def test_a_launcher_started_with_interpreter_options_starts_its_workers_plain(tmp_path, no_leftovers):
    """python -O: a forked worker would keep the launcher's optimisation level (asserts off); a plain one
    is started without it, as torchrun's are."""
    script = tmp_path / "reader.py"
    script.write_text(READER)
    proc = subprocess.run([PY, "-O", "-m", "multigpu", "run", "--nproc", "2", str(script), no_leftovers],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=150, env=child_env())
    assert proc.returncode == 0, proc.stderr.decode()
    import ast

    records = [ast.literal_eval(line) for line in proc.stdout.decode().splitlines() if line.startswith("{")]
    assert len(records) == 2
    assert all(r["parent"] != "multigpu-fork" and r["optimize"] == 0 for r in records), records
