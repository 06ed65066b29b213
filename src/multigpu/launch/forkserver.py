"""Workers forked from a process that has imported torch already: no rank, first or restarted, pays
torch's start-up again.

Why: importing torch costs 2.5-3 s of CPU here, and the first optimizer step imports ``torch._dynamo``
(2 s more), in every worker and again at every restart (a 2-process launch: three imports of torch).

How: the launcher imports torch (it needs it for torch's agent), binds a Unix socket in a private folder
(mode 0700) and forks this server from itself before torch's agent starts any thread: one import of
torch serves the launcher and every worker (a separate server process cost a second import, ~3 s of CPU
per launch). The server sheds the launcher's state (:func:`_become_server`), imports ``torch._dynamo``
where several workers or restarts share it, then waits. torch's agent still starts one process per
rank, but a small one (:mod:`.boot`, no torch): it sends the server its arguments, environment, folder
and stdin/stdout/stderr; the server forks a worker that takes them over and runs :mod:`.worker` as the
plain start would. The boot process stays what the agent watches and signals: it passes signals on to
the worker's process group and leaves with the worker's status or signal. A boot process that dies
(SIGKILL) takes its worker with it. The launcher lowers torch's C++ log level after the fork (:mod:`.torch_logs`).

What a forked worker gets fresh: its own session (as torch's agent gives each worker), signal
handlers as a new interpreter has them, the environment, folder, umask and ``sys.path`` of its boot
process, Python's, numpy's and torch's random state from the OS (as at start-up). It dies with the
server (``PR_SET_PDEATHSIG``), which dies with the launcher. (A queue's launchers, :mod:`.launchers`, are
stopped cleanly instead: SIGTERM.)

When the plain start is used instead (the boot process ``exec``s the worker itself): GPU runs (a CUDA
driver initialised before ``fork`` does not work in the child, and nothing here may initialise it - not
tried on a GPU yet), ``MULTIGPU_WORKER_START=plain``, a worker environment that differs from the
server's in anything but the per-rank variables torch's agent sets (variables read at import, such as
``OMP_NUM_THREADS`` or ``TORCH_LOGS``, must be what the worker would have seen), and a server that is
gone or failed to import torch.

What differs from a new interpreter, and stays so: ``sys.flags`` are the launcher's (``python -u``'s
``unbuffered`` flag is 0, though stdout and stderr are unbuffered as under ``-u``), and ``sys.modules``
holds the launcher's modules too (``argparse``...: :func:`shadows` counts them).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from multigpu.errors import LaunchError
from multigpu.fileio import Folder, open_devnull
from multigpu.launch.boot import FORKSERVER_VAR, FORWARDED
from multigpu.launch.fork_rules import PER_WORKER, READ_AT_RUN_TIME, START_VAR, declines, shadows  # noqa: F401
from multigpu.launch.fork_wire import receive
from multigpu.launch.process import (
    collector_paused,
    die_with_parent,
    fresh_random_state,
    name_process,
    parent_of,
)

_SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes
#: What the kernel sends the server when its launcher dies (a real-time signal nobody else sends).
LAUNCHER_GONE = signal.SIGRTMIN + 3
#: How long a queue's server may take to leave once asked (it has only its launchers' last signals to pass on).
STOP_WAIT_S = 10.0
#: A boot process sends its whole request at once: one that trickles is dropped (and starts the plain way).
REQUEST_TIMEOUT_S = 5.0


@dataclass
class ForkServer:
    """The launcher's handle: the server process and its private folder."""

    pid: int
    folder: str
    path: str
    ended: bool = False
    launchers: bool = False

    @classmethod
    def start(cls, keep: Callable[["ForkServer"], None], verbose: bool = False, stderr: Optional[int] = None,
              dynamo: bool = True, launchers: bool = False, import_env: Optional[dict[str, Any]] = None) -> None:
        """Fork a server from this process for the workers about to be launched and hand it to ``keep`` (not
        called: they start the plain way). Call it with no other thread running, and torch imported with this
        environment or not at all (the server imports it then). The caller puts ``path`` into the workers'
        environment. ``verbose``: the server says on ``stderr`` (default: ours) why a worker starts the plain
        way. ``dynamo``: import ``torch._dynamo`` for the workers (~2 s each at their first step). ``launchers``:
        a queue's server, which forks ``multigpu run`` launchers for boot processes (see :mod:`.launchers`);
        ``import_env``: variables it sets before it imports torch (where this process has not).
        Why ``keep``, not a return value: a stop signal whose handler raises, landing between the folder's
        creation and the caller's hold on the handle, left the folder behind. Call it with such signals held
        (:meth:`.process.StopSignals.held`, as the launcher does): the caller then holds the server when one
        raises. Otherwise (``multigpu check``'s Ctrl-C) instants are left where one can: a server forked
        leaves, and removes its folder, when this process ends; a folder made just before may stay."""
        if threading.active_count() > 1:  # a fork copies only this thread: a lock another one holds stays held
            return
        server = cls._fork(verbose, stderr, dynamo, launchers, import_env)
        if server is not None:
            try:
                keep(server)
            except BaseException:
                server.stop()
                raise

    @classmethod
    def _fork(cls, verbose: bool, stderr: Optional[int], dynamo: bool, launchers: bool,
              import_env: Optional[dict[str, Any]]) -> Optional["ForkServer"]:
        """:meth:`start`'s work: the folder, the socket, the fork."""
        try:
            folder = tempfile.mkdtemp(prefix="multigpu-fork-")  # mode 0700: only this user can connect
            if len(os.path.join(folder, "socket").encode()) > _SOCKET_PATH_MAX:  # a deep TMPDIR
                Folder(Path(folder).parent).remove_tree(Path(folder).name)
                folder = tempfile.mkdtemp(prefix="multigpu-fork-", dir="/tmp")
        except OSError:  # no temporary folder: the plain start
            return None
        path = os.path.join(folder, "socket")
        pid = 0
        listener: Optional[socket.socket] = None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                # Not 0-2 (a launcher started with stdin closed would hand the socket out as the server's stdin).
                listener = socket.socket(fileno=fcntl.fcntl(raw.fileno(), fcntl.F_DUPFD_CLOEXEC, 3))
            listener.bind(path)
            listener.listen(256)
            launcher = os.getpid()
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # as it is (a pending stop signal raises here)
            try:  # every signal waits until the child has put the server's handlers in place (ours raise)
                signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
                pid = os.fork()
                if pid == 0:
                    try:
                        if "torch" not in sys.modules:
                            os.environ.update(import_env or {})
                        _become_server(listener, launcher, path, verbose, stderr, mask, dynamo, launchers)
                    finally:
                        os._exit(70)  # never back into the launcher's code
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        except BaseException as exc:  # a failed start, or a stop signal not held while starting (see start)
            if pid:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            Folder(Path(folder).parent).remove_tree(Path(folder).name)
            if isinstance(exc, OSError):
                return None
            raise
        finally:
            if listener is not None:
                listener.close()
        return cls(pid, folder, path, launchers=launchers)

    def running(self) -> bool:
        """The server has not ended (it is our child: an ended one is reaped here, once)."""
        if self.ended:
            return False
        try:
            self.ended = os.waitpid(self.pid, os.WNOHANG) != (0, 0)
        except ChildProcessError:
            self.ended = True
        return not self.ended

    def release(self) -> None:
        """Let the server go while its launchers still run (a queue that failed while stopping them): it
        starts nothing more and leaves when they have, as when the queue dies."""
        if self.running():
            with contextlib.suppress(OSError):
                os.kill(self.pid, LAUNCHER_GONE)
            self.ended = True
        else:  # gone already: its folder is ours to remove
            self.stop()

    def stop(self) -> None:
        """After the launch: a worker server's workers die with it. A queue's server is asked to leave first
        (it SIGKILLs the launcher of a boot process the queue killed, then leaves when its launchers have);
        SIGKILL only where it has not left in ``STOP_WAIT_S``: a launcher must never outlive it unsignalled."""
        if self.launchers and self.running():
            with contextlib.suppress(OSError):
                os.kill(self.pid, LAUNCHER_GONE)
            deadline = time.monotonic() + STOP_WAIT_S
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.02)
        if not self.ended:  # reaped already: its pid may be another process's by now
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.ended = True
        with contextlib.suppress(OSError):
            Folder(Path(self.folder).parent).remove_tree(Path(self.folder).name)


def _become_server(listener: socket.socket, launcher: int, path: str, verbose: bool, stderr: Optional[int],
                   mask: set[int | signal.Signals], dynamo: bool, launchers: bool = False) -> NoReturn:
    """In the child forked by :meth:`ForkServer.start`: shed the launcher's state, then serve.

    What the launcher had that a server must not keep: its signal handlers (they raise into the
    launcher's code), its session and terminal, its stdin and stdout, any other descriptor, its folder
    (the server runs in ``/``; the launcher's folder, first on ``sys.path`` under ``python -m``, could hold
    a ``numpy.py``), its buffered streams (workers write unbuffered, as ``python -u`` would)."""
    try:
        for sig in signal.valid_signals():
            with contextlib.suppress(OSError, ValueError, TypeError):
                if callable(signal.getsignal(sig)) and sig != signal.SIGINT:
                    signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        server = Server(listener, launcher, verbose, launchers)
        signal.signal(LAUNCHER_GONE, lambda *_: server.owner_gone())
        if not die_with_parent(LAUNCHER_GONE) or os.getppid() != launcher:
            _remove_folder_and_exit(listener)
        _standard_fds(stderr, keep=listener.fileno())
        cwd = os.getcwd()
        os.chdir("/")
        if sys.path and sys.path[0] in ("", cwd):  # python -m multigpu: the launcher's folder
            sys.path.pop(0)
        os.environ[FORKSERVER_VAR] = path
        server.env = dict(os.environ)
        name_process(b"multigpu-fork")
        # Slurm signals every process of a job step (USR1 before the time limit, TERM when cancelled): the
        # workers act on them; the server goes on until its launcher ends it or dies.
        for sig in FORWARDED:
            if sig not in (signal.SIGCONT, signal.SIGWINCH):
                signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        server.serve(dynamo)
    except BaseException as exc:  # the launches go on the plain way (their boot processes find no server)
        _say_failed("the fork server", exc)
    finally:
        os._exit(70)


def _say_failed(what: str, exc: BaseException, fd: int = 2) -> None:
    """One line on ``fd`` (stderr; -1: nowhere), never a traceback (what failed is ours, not the user's script)."""
    if fd < 0:
        return
    with contextlib.suppress(Exception):
        line = LaunchError(f"{what} failed: {type(exc).__name__}: {exc}",
                           f"check the folder and environment it was started in; {START_VAR}=plain starts every "
                           "process as a new interpreter.").one_line()
        os.write(fd, (line + "\n").encode(errors="backslashreplace"))


def _standard_fds(stderr: Optional[int], keep: int) -> None:
    """stdin and stdout on /dev/null, stderr on ``stderr`` (None: as it is); every other descriptor but
    ``keep`` closed (a worker forked from here would inherit it). Fresh unbuffered ``sys`` streams: the
    launcher's may hold buffered text, or a lock another thread held at the fork."""
    devnull = open_devnull()
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    if stderr is not None:
        os.dup2(stderr, 2)
    else:
        try:
            os.fstat(2)
        except OSError:  # the launcher's stderr was closed
            os.dup2(devnull, 2)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        raw.name = f"<{name}>"
        stream = io.TextIOWrapper(io.BufferedReader(raw) if fd == 0 else raw, write_through=fd > 0, newline="\n",
                                  encoding=getattr(old, "encoding", None),
                                  errors=getattr(old, "errors", "backslashreplace" if fd == 2 else "strict"))
        stream.mode = "r" if fd == 0 else "w"  # type: ignore[misc]  # as Python sets them on its own
        for attribute in (name, f"__{name}__"):
            setattr(sys, attribute, stream)


def _preimport(dynamo: bool, launchers: bool = False) -> Optional[str]:
    """What every worker imports: once, here. Returns why forking is off (None: it is on)."""
    try:
        import torch
        import torch.distributed  # noqa: F401

        if dynamo:
            import torch._dynamo  # noqa: F401  (the first optimizer step imports it: ~2 s)
    except Exception as exc:  # the plain start will show the real error
        return f"importing torch failed ({type(exc).__name__})"
    if torch.cuda.is_initialized():
        return "CUDA was initialised while importing torch"
    with contextlib.suppress(Exception):
        import numpy  # noqa: F401
    import multigpu.launch.worker  # noqa: F401

    if launchers:  # what `multigpu run` imports (its command line, ~30 ms, the launcher reads itself)
        import torch.distributed.launcher.api  # noqa: F401

        import multigpu.launch.local  # noqa: F401
    return None


class Server:
    """One process, one thread: accepts boot processes, forks workers, reaps them, passes signals on."""

    def __init__(self, listener: socket.socket, launcher: int, verbose: bool = False, launchers: bool = False
                 ) -> None:
        self.listener, self.launcher, self.env, self.verbose = listener, launcher, dict(os.environ), verbose
        self.launchers = launchers
        self.closing = False  # the queue is gone: no new launcher; the server leaves when its launchers have
        self.refusal: Optional[str] = None
        self.partial: dict[socket.socket, bytes] = {}  # an unfinished signal line per boot connection
        self.worker_of: dict[socket.socket, int] = {}  # boot connection -> its worker's pid
        self.boot_of: dict[int, socket.socket] = {}    # worker pid (not yet reaped) -> boot connection

    def serve(self, dynamo: bool = True) -> NoReturn:
        # Every object so far into the collector's permanent generation: a forked process never scans it, so
        # it neither copies the shared pages nor spends ~0.25 s per collection (a worker's last one, at exit),
        # and never finalizes the launcher's garbage, whose descriptors the server closed.
        with collector_paused(freeze=True):
            self.refusal = _preimport(dynamo, self.launchers)
        self.selector = selectors.DefaultSelector()  # here, after _standard_fds closed every other descriptor
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "reap")
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self.accept()
                elif key.data == "reap":
                    with contextlib.suppress(OSError):
                        os.read(self.wake_r, 4096)
                    self.reap()
                    if self.closing and not self.boot_of:
                        _remove_folder_and_exit(self.listener)
                else:
                    self.from_boot(key.fileobj)  # type: ignore[arg-type]

    def accept(self) -> None:
        if self.closing:  # asked to leave in the same wake-up that found a connection
            return
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        pid = 0
        try:
            peer, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid() or parent_of(peer) != self.launcher:
                raise ValueError("not a process the launcher started")  # its agent starts every boot process
            request, fds = receive(conn, deadline=time.monotonic() + REQUEST_TIMEOUT_S)
            launcher = request["kind"] == "launcher"
            why = self.refusal or ("not this server's kind" if launcher != self.launchers else None) or \
                declines(self.env, request["env"], launcher) or shadows(request)
            if why:
                conn.sendall(b'{"plain": true}\n')  # why stays here: the environment is not echoed to a client
                if self.verbose:
                    print(f"multigpu: rank {request['env'].get('RANK', '?')[:12]} starts the plain way: {why}",
                          file=sys.stderr, flush=True)
                raise ValueError("plain start")
            pid = self.fork(request, fds, conn)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except Exception:  # a malformed request, or a boot process already gone: never the server's end
            if pid:  # forked, but nobody is left to wait for it
                self.signal(pid, signal.SIGKILL)
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.worker_of[conn], self.boot_of[pid] = pid, conn
        self.selector.register(conn, selectors.EVENT_READ, "boot")

    def fork(self, request: dict[str, Any], fds: list[int], conn: socket.socket) -> int:
        """Signals stay blocked across the fork, so one passed on at once waits for the worker's handlers."""
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            with warnings.catch_warnings():  # Python 3.12 warns about forking with torch's idle thread
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                self.become_worker(request, fds, conn)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return pid

    def from_boot(self, conn: socket.socket) -> None:
        """A signal to pass on, or the boot process is gone (its worker goes too)."""
        pid = self.worker_of.get(conn)
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            self.drop(conn)
            if pid in self.boot_of:
                self.signal(pid, signal.SIGKILL)
            return
        *lines, rest = (self.partial.pop(conn, b"") + data).split(b"\n")
        if len(rest) < 256:  # a signal line is a dozen bytes
            self.partial[conn] = rest
        for line in lines:
            try:
                number = json.loads(line).get("signal")
            except Exception:  # not JSON, not an object: ignored
                continue
            if type(number) is int and 0 < number < signal.NSIG and pid in self.boot_of:
                self.signal(pid, number)

    def owner_gone(self) -> None:
        """The launcher (or queue) that started this server died: a worker server leaves (its workers die
        with it). A queue's server starts nothing more and leaves when its launchers have: their boot
        processes die with the queue by SIGTERM and pass it on (the server must be here to do so; a
        SIGTERM of its own would be a second one)."""
        if not self.launchers or not self.boot_of:
            _remove_folder_and_exit(self.listener)
        self.closing = True
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)

    @staticmethod
    def signal(pid: int, number: int) -> None:
        """To the worker's process group (torch's agent signals a worker's whole group), or to the worker
        alone in the moment before it has made its own group."""
        try:
            os.killpg(pid, number)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.boot_of.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.settimeout(5)
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                self.drop(conn)

    def drop(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        self.worker_of.pop(conn, None)
        self.partial.pop(conn, None)
        conn.close()

    def become_worker(self, request: dict[str, Any], fds: list[int], conn: socket.socket) -> NoReturn:
        """In the forked child: take over the boot process's place, then run the worker."""
        server = os.getppid()
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                        signal.SIGUSR2, LAUNCHER_GONE):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.selector.close()
            for other in (self.listener, conn, *self.worker_of):
                other.close()
            os.setsid()
            # A worker dies with the server (the launcher is gone); a queue's launcher is stopped cleanly
            # (its workers checkpoint), and its boot process waits for it (boot.main).
            if not die_with_parent(signal.SIGTERM if request["kind"] == "launcher" else signal.SIGKILL) \
                    or os.getppid() != server:
                os._exit(1)
            name_process(os.path.basename(sys.executable).encode())  # as a new interpreter is named
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            fds.clear()
            for target in request["closed"]:  # closed in the boot process: closed here too, and None in
                os.close(target)               # sys, as a new interpreter has it
                name = ("stdin", "stdout", "stderr")[target]
                setattr(sys, name, None)
                setattr(sys, f"__{name}__", None)
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            os.umask(request["umask"])
            sys.path[:] = request["path"]
            fresh_random_state()
            if request["kind"] == "launcher":
                from multigpu.launch.launchers import run_launcher

                run_launcher(request["argv"])
            from multigpu.launch import worker

            worker.main(request["argv"], forked=True)
        except BaseException as exc:  # before the dup2 our stderr is the server's (/dev/null for a queue's)
            closed_stderr = 2 in request["closed"]  # then descriptor 2 may be one of the worker's files
            _say_failed(f"starting a forked {request['kind']}", exc, fd=fds[2] if len(fds) == 3 else (-1 if closed_stderr else 2))
        finally:
            os._exit(70)


def _remove_folder_and_exit(listener: socket.socket) -> NoReturn:
    with contextlib.suppress(Exception):
        folder = Path(listener.getsockname()).parent
        if folder.name.startswith("multigpu-fork-"):
            Folder(folder.parent).remove_tree(folder.name)
    os._exit(0)
