"""What torch's agent starts for each rank: a small process that has the worker forked from the launcher's
fork server (:mod:`.forkserver`, torch already imported there), passes signals on, and leaves with the
worker's own exit status or signal - so the agent, and everything it reports, sees what it would see if
it had started the worker itself.

Standard library and :mod:`multigpu.launch.worker`'s light imports only (no torch: this process starts in
~0.1 s).
When there is no fork server, or it declines (see :func:`.forkserver.declines`), or it is gone, this
process *becomes* the plain worker (``exec`` of ``python -u -m multigpu.launch.worker ...``: same pid,
nothing lost but the start-up time).

The wire format on the Unix socket: :mod:`.fork_wire`.

Usage (by the launcher): ``python -u -m multigpu.launch.boot script.py args...`` or ``-m pkg.mod args...``;
by a queue (:mod:`.launchers`): ``MULTIGPU_BOOT_LAUNCHER=1 python -m multigpu.launch.boot run FLAGS ...``
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import socket
import sys
import time
from typing import Any, NoReturn, Optional

from multigpu.fileio import Folder, open_devnull
from multigpu.launch.fork_wire import HEADER, LineReader, frame
from multigpu.launch.worker import die_with_launcher

#: The fork server's socket (set by the launcher for its workers; absent: the plain start).
FORKSERVER_VAR = "MULTIGPU_FORKSERVER"
#: ``1``: what to ask for is a launcher (``multigpu ARGV``, a queue's run: :mod:`.launchers`), not a worker.
#: A variable, not an argument: any argument may be a script's name. Removed before anything sees it.
LAUNCHER_VAR = "MULTIGPU_BOOT_LAUNCHER"
WORKER_MODULE = "multigpu.launch.worker"
#: Signals torch's agent (or a user) sends a worker: passed to the forked worker's process group.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGWINCH)
def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None when the launcher started us with the descriptor closed
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def plain(argv: list[str], launcher: bool = False) -> NoReturn:
    """Become the worker the ordinary way (the launcher's start without a fork server); ``launcher``:
    become ``python -m multigpu ARGV`` (a queue's run, :mod:`.launchers`)."""
    _flush()
    if launcher:
        os.execv(sys.executable, [sys.executable, "-m", "multigpu", *argv])
    os.execv(sys.executable, [sys.executable, "-u", "-m", WORKER_MODULE, *argv])


def request(argv: list[str], closed: list[int], launcher: bool = False) -> dict[str, Any]:
    return {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path),
            "umask": _umask(), "closed": closed, "kind": "launcher" if launcher else "worker"}


def standard_fds() -> tuple[list[int], list[int]]:
    """Our stdin, stdout and stderr to hand over, and which of them are closed (the launcher may have been
    started with ``<&-``): /dev/null goes in their place, and the worker closes it again."""
    fds, closed = [], []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(open_devnull())
            closed.append(fd)
    return fds, closed


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def mirror(status: int) -> NoReturn:
    """Leave as the worker left: its exit status, or killed by its signal."""
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    die_by(os.WTERMSIG(status) if os.WIFSIGNALED(status) else signal.SIGKILL)


def die_by(sig: int) -> NoReturn:
    """Die by ``sig`` (the agent reads the signal from our status), without a core file of our own: a
    worker that crashed wrote its core already, and ours would overwrite it."""
    _flush()
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught, nor reset
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default is to go on (SIGCHLD...): leave with the shell's number


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher = os.environ.pop(LAUNCHER_VAR, None) == "1"
    path = os.environ.get(FORKSERVER_VAR)
    if not path:
        plain(argv, launcher)
    if not launcher:  # a queue's run dies with its queue as the queue asked (SIGTERM: a clean stop)
        die_with_launcher()
    # Before the socket: a closed 0, 1 or 2 would otherwise be the socket's number, and the worker would get
    # the socket as its stdin or stdout (/dev/null goes there; the worker closes it again).
    fds, closed = standard_fds()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        """Sent at once: the server reads it once the worker exists (it is queued on the socket until then)."""
        received.append(signum)
        with contextlib.suppress(OSError):
            sock.sendall(json.dumps({"signal": int(signum)}).encode() + b"\n")

    try:
        sock.connect(path)
        data = frame(request(argv, closed, launcher))
        sent = socket.send_fds(sock, [data[:HEADER.size]], fds)
        sock.sendall(data[sent:])
    except OSError:
        sock.close()
        for slot in closed:  # the plain worker finds them closed, as we did
            os.close(fds[slot])
        plain(argv, launcher)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    reader = LineReader(sock)
    answer = reader.next()  # waits while the server is still importing torch
    if answer is None or not isinstance(answer.get("pid"), int):
        sock.close()
        stops = [sig for sig in received if sig not in (signal.SIGCONT, signal.SIGWINCH)]
        if stops:  # stopped before a worker existed: the plain one is not started either
            die_by(stops[0])
        plain(argv, launcher)  # exec resets our handlers
    watch = _pidfd(answer["pid"]) if launcher else None  # taken now, while the server holds the launcher
    while True:
        message = reader.next()
        if message is None:  # the server died; its workers die with it (PR_SET_PDEATHSIG)
            if launcher:  # a launcher is stopped cleanly instead (SIGTERM): see it out
                outlive(answer["pid"], watch)
            die_by(signal.SIGKILL)
        if isinstance(message.get("status"), int):
            mirror(message["status"])


def _pidfd(pid: int) -> Optional[int]:
    """A descriptor that becomes readable when process ``pid`` ends (a zombie counts), or None."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # a kernel before 5.3, or the process is gone already
        return None


def outlive(pid: int, watch: Optional[int]) -> NoReturn:
    """The server died and its launcher got SIGTERM: pass later signals to the launcher itself (but not the
    queue's SIGTERM or SIGHUP: it is stopping already), wait until it has ended, then leave with 143 - the
    queue counts the run as interrupted, and the next queue resumes it."""
    def direct(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            os.killpg(pid, signum)

    for sig in FORWARDED:  # not the queue's stop (SIGTERM, SIGHUP): a second one would cut the clean stop short
        signal.signal(sig, signal.SIG_IGN if sig in (signal.SIGTERM, signal.SIGHUP) else direct)
    if watch is not None:
        while True:
            with contextlib.suppress(InterruptedError):
                if select.select([watch], [], [])[0]:
                    break
    else:  # no pidfd: its /proc entry, until it is gone or a zombie
        while _alive(pid):
            time.sleep(0.2)
    _flush()
    os._exit(128 + signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        return Folder(f"/proc/{pid}").load_text("stat", limit=4096).rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return False


if __name__ == "__main__":
    main()
