"""What torch's agent starts for each rank: a small process that has the worker forked from the launcher's
fork server (:mod:`.forkserver`, torch already imported there), passes signals on, and leaves with the
worker's own exit status or signal - so the agent, and everything it reports, sees what it would see if
it had started the worker itself.

Standard library and :mod:`multigpu.launch.worker`'s light imports only (no torch: this process starts in
~0.1 s).
When there is no fork server, or it declines (see :func:`.forkserver.declines`), or it is gone, this
process *becomes* the plain worker (``exec`` of ``python -u -m multigpu.launch.worker ...``: same pid,
nothing lost but the start-up time).

Wire format on the Unix socket: boot -> server, one frame (8-byte big-endian length + JSON) sent with
its stdin/stdout/stderr attached (SCM_RIGHTS), then lines ``{"signal": N}``; server -> boot, lines
``{"pid": P}`` or ``{"plain": WHY}``, then ``{"status": WAITSTATUS}`` when the worker has ended.

Usage (by the launcher): ``python -u -m multigpu.launch.boot script.py args...`` or ``-m pkg.mod args...``
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import struct
import sys
from typing import NoReturn, Optional

from multigpu.fileio import open_devnull
from multigpu.launch.worker import die_with_launcher

#: The fork server's socket (set by the launcher for its workers; absent: the plain start).
FORKSERVER_VAR = "MULTIGPU_FORKSERVER"
WORKER_MODULE = "multigpu.launch.worker"
#: Signals torch's agent (or a user) sends a worker: passed to the forked worker's process group.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGWINCH)
HEADER = struct.Struct(">Q")
MAX_FRAME = 16 << 20


def frame(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return HEADER.pack(len(data)) + data


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None when the launcher started us with the descriptor closed
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def plain(argv: list[str]) -> NoReturn:
    """Become the worker the ordinary way (the launcher's start without a fork server)."""
    _flush()
    os.execv(sys.executable, [sys.executable, "-u", "-m", WORKER_MODULE, *argv])


def request(argv: list[str], closed: list[int]) -> dict:
    return {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path),
            "umask": _umask(), "closed": closed}


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


class LineReader:
    """JSON lines from a stream socket (None at EOF)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, b""

    def next(self) -> Optional[dict]:
        while b"\n" not in self.buffer:
            try:
                chunk = self.sock.recv(4096)
            except OSError:
                return None
            if not chunk:
                return None
            self.buffer += chunk
            if len(self.buffer) > MAX_FRAME:
                return None
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            message = json.loads(line)
        except ValueError:
            return None
        return message if isinstance(message, dict) else None


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
    path = os.environ.get(FORKSERVER_VAR)
    if not path:
        plain(argv)
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
        data = frame(request(argv, closed))
        sent = socket.send_fds(sock, [data[:HEADER.size]], fds)
        sock.sendall(data[sent:])
    except OSError:
        sock.close()
        for slot in closed:  # the plain worker finds them closed, as we did
            os.close(fds[slot])
        plain(argv)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    reader = LineReader(sock)
    answer = reader.next()  # waits while the server is still importing torch
    if answer is None or not isinstance(answer.get("pid"), int):
        sock.close()
        stops = [sig for sig in received if sig not in (signal.SIGCONT, signal.SIGWINCH)]
        if stops:  # stopped before a worker existed: the plain one is not started either
            die_by(stops[0])
        plain(argv)  # exec resets our handlers
    while True:
        message = reader.next()
        if message is None:  # the server died; its workers die with it (PR_SET_PDEATHSIG)
            die_by(signal.SIGKILL)
        if isinstance(message.get("status"), int):
            mirror(message["status"])


if __name__ == "__main__":
    main()
