"""A worker that finished its script but does not exit: named, its Python stacks kept, ended - never a
launcher that waits forever with no word.

Why: torch's agent waits for every worker to exit, however long that takes. A rank can finish its script
and then hang in its teardown - a destructor, an exit handler, a thread that will not end (the PyTorch DDP
tutorial's script under the old forked worker start hung so in 7 of 45 launches: the main thread in
``c10d::Reducer::~Reducer`` -> ``~ProcessGroupGloo`` waiting for a mutex while holding the GIL, gloo's own
thread waiting for the GIL) - and the job then never ends, on a cluster until its time limit.

How: each worker records the end of its script (``rankR.attemptK.exit``, :mod:`.attempts`) before its
teardown and from then on dumps its threads' Python stacks on SIGUSR2 (``faulthandler``, which needs no
GIL: the hang above holds it). :class:`ExitWatch`, a thread of the launcher, reads those records once
every local worker of the newest attempt has finished its script or exited, and from then on watches each
live one's progress: its CPU time (``/proc/PID/stat``, every thread) and the bytes it reads and writes
(``/proc/PID/io``, files and sockets alike). A worker that is still writing its last asynchronous
checkpoint, pickling a large state, uploading its logs or waiting in the goodbye barrier for another
node's ranks (bounded at 60 s) moves; one that waits on a lock, a thread or a peer that will never come
does not. Once no live worker has moved for ``timeout_s`` each gets SIGUSR2 (its stacks go to
``rankR.attemptK.stacks``), then SIGKILL - through a pidfd, so that a pid the kernel gave to another
process meanwhile is never signalled. Not one while another still moves: torch's agent would then stop
that one too, in the middle of its last checkpoint. "Moved" means a byte read or written, or CPU time
that is work (:func:`_moved`): the few milliseconds a second an idle watchdog thread of torch's takes are
not progress. The clock starts only when every local rank has finished its script, so a rank that
waits for a slower one is not mistaken for a hung one; the records are this launch's only (the launcher
clears a reused ``--log-dir`` of them first).

torch's agent would count the ended rank as failed: it would stop the others or restart every worker - a
script that had finished would run again. While a launch runs, :func:`ended_ranks_succeed` wraps the
agent's ``_monitor_workers`` (:func:`.torch_agent.swapped`, as for the agent's other changes): an attempt
whose only failures are workers this watch ended after their scripts had succeeded (status 0) has
succeeded. A script that failed stays a failure (its restart, its report). The launcher then says which
rank, where its stacks are, and exits with :data:`~multigpu.errors.EXIT_STUCK_AT_EXIT`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from multigpu.fileio import Folder
from multigpu.launch.attempts import files_of, read_int, record_path

#: ``multigpu run --exit-timeout``'s default: longer than the goodbye barrier's 60 s wait for other nodes.
EXIT_TIMEOUT_S = 90
#: The signal a worker dumps its stacks on once its script has ended (worker.py; never before: it is the user's).
STACKS_SIGNAL = signal.SIGUSR2
#: How long the watch waits for the stacks to be written before it ends the worker anyway.
DUMP_WAIT_S = 3.0
#: CPU a worker must spend (since it last moved) to count as moving, when it reads and writes nothing: at
#: least this many seconds, and more than this share of the time (a stuck process's polling threads use less).
BUSY_CPU_S = 0.5
IDLE_CPU_SHARE = 0.05

_lock = threading.Lock()
#: Pids of workers some watch of this process ended after their scripts ended with status 0: the agent's
#: wrapped monitor counts their failure as that success.
_ended_succeeded: set[int] = set()


@dataclass(frozen=True)
class Ended:
    rank: int
    pid: int
    #: What the worker's script ended with (its exit record).
    status: int
    stacks: Path

    def written(self) -> bool:
        """The stacks file holds the dump (it is a regular file with something in it)."""
        try:
            return (
                self.stacks.is_file()
                and not self.stacks.is_symlink()
                and self.stacks.stat().st_size > 0
            )
        except OSError:
            return False

    def where(self) -> str:
        """The innermost frame of the first thread in the stacks file ('' when there is none to read)."""
        try:
            text = Folder(self.stacks.parent).load_text(self.stacks.name, limit=256 * 1024)
        except OSError:
            return ""
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("File "):
                return line[len("File ") :]
        return ""


def _our_live_child(pid: int) -> bool:
    """``pid`` is a child of this process (torch's agent started it here) and has not exited."""
    try:
        fields = Folder(f"/proc/{pid}").load_text("stat", limit=4096).rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return len(fields) > 1 and fields[0] != "Z" and fields[1] == str(os.getpid())


def _progress(pid: int) -> Optional[tuple[float, int]]:
    """(CPU seconds, bytes read and written) of process ``pid`` so far; None when it cannot be read."""
    try:
        proc = Folder(f"/proc/{pid}")
        fields = proc.load_text("stat", limit=4096).rsplit(")", 1)[1].split()
        # utime, stime: every thread
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        counts = dict(
            line.split(": ", 1)
            for line in proc.load_text("io", limit=4096).splitlines()
            if ": " in line
        )
        return cpu, int(counts.get("rchar", 0)) + int(counts.get("wchar", 0))
    except (OSError, IndexError, ValueError):
        return None


def _moved(last: "_Watched", cpu: float, io: int, now: float) -> bool:
    """A byte read or written, or CPU time that is work: :data:`BUSY_CPU_S` at least, and more than
    :data:`IDLE_CPU_SHARE` of the time since it last moved (a thread that wakes to poll is not work)."""
    spent = cpu - last.cpu
    return io != last.io or (spent >= BUSY_CPU_S and spent >= IDLE_CPU_SHARE * (now - last.since))


@dataclass
class _Watched:
    """What the watch last saw of one worker that has finished its script."""

    pid: int
    cpu: float
    io: int
    since: float  # when it last moved


class ExitWatch:
    """The launcher's watch over its workers' exits (see the module's docstring); a context manager."""

    def __init__(self, log_dir: str, nproc: int, timeout_s: float, poll_s: float = 0.5) -> None:
        self.log_dir, self.nproc, self.timeout_s, self.poll_s = log_dir, nproc, timeout_s, poll_s
        self.ended: list[Ended] = []
        self._stop = threading.Event()
        self._attempt: Optional[int] = None
        # rank -> what was seen of it, once every local rank finished
        self._watched: dict[int, _Watched] = {}
        self._thread = threading.Thread(target=self._run, name="multigpu-exit-watch", daemon=True)

    def __enter__(self) -> "ExitWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        with _lock:
            _ended_succeeded.difference_update(e.pid for e in self.ended)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check(time.monotonic())
            except OSError:  # a folder being removed under us: the next poll reads it again
                continue

    def check(self, now: float, progress: Any = _progress) -> None:
        """One look at the newest attempt's records and at its workers; ends what has not moved for
        ``timeout_s`` since every local rank finished its script. ``progress``: pid -> (CPU s, bytes)."""
        started = files_of(self.log_dir, "pid")
        if not started:
            return
        attempt = max(found for _, found, _ in started)
        if attempt != self._attempt:
            self._attempt, self._watched = attempt, {}
        pids = {
            rank: pid
            for rank, found, path in started
            if found == attempt and (pid := read_int(path)) is not None
        }
        finished = {rank for rank, found, _ in files_of(self.log_dir, "exit") if found == attempt}
        alive = {rank: pid for rank, pid in pids.items() if _our_live_child(pid)}
        if len(pids) < self.nproc or not alive or not set(alive) <= finished:
            self._watched = {}  # still starting, all gone, or a rank still in its script
            return
        for rank, pid in sorted(alive.items()):
            seen = progress(pid)
            last = self._watched.get(rank)
            if seen is None:
                continue
            cpu, io = seen
            if last is None or last.pid != pid or _moved(last, cpu, io, now):
                self._watched[rank] = _Watched(pid, cpu, io, now)
        stalled = {
            rank: pid
            for rank, pid in alive.items()
            if rank in self._watched and now - self._watched[rank].since >= self.timeout_s
        }
        # only when none is moving: ending one while another still writes its last checkpoint would have
        # torch's agent stop that one too
        if stalled and len(stalled) == len(alive):
            for rank, pid in sorted(stalled.items()):
                self._end(rank, attempt, pid)
                del self._watched[rank]

    def _end(self, rank: int, attempt: int, pid: int) -> None:
        try:  # a pidfd: the signals reach this process, never one that took its pid after it
            handle = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        try:
            if not _our_live_child(pid):  # it left between the look and the pidfd
                return
            stacks = record_path(self.log_dir, rank, attempt, "stacks")
            status = read_int(record_path(self.log_dir, rank, attempt, "exit"))
            if status == 0:
                with _lock:  # before any signal: the agent may see it die at once
                    _ended_succeeded.add(pid)
            self.ended.append(Ended(rank, pid, status if status is not None else 1, stacks))
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(handle, STACKS_SIGNAL)
                deadline, size = time.monotonic() + DUMP_WAIT_S, -1
                while time.monotonic() < deadline:  # written, and no longer growing
                    time.sleep(0.2)
                    now_size = (
                        stacks.stat().st_size if stacks.exists() and not stacks.is_symlink() else 0
                    )
                    if now_size and now_size == size:
                        break
                    size = now_size
                signal.pidfd_send_signal(handle, signal.SIGKILL)
        finally:
            os.close(handle)


def ended_ranks_succeed() -> contextlib.AbstractContextManager[None]:
    """Inside this block, a failure of torch's agent whose every failed worker was ended by an
    :class:`ExitWatch` (its script had finished) is the attempt's success (see the module's docstring)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from multigpu.launch.torch_agent import swapped

    original = LocalElasticAgent._monitor_workers

    def monitor(agent: Any, worker_group: Any) -> Any:
        result = original(agent, worker_group)
        if result.state == WorkerState.FAILED and result.failures:
            with _lock:
                ours = {failure.pid for failure in result.failures.values()} <= _ended_succeeded
            if ours:
                return RunResult(
                    state=WorkerState.SUCCEEDED,
                    return_values={worker.global_rank: None for worker in worker_group.workers},
                )
        return result

    return swapped(LocalElasticAgent, "_monitor_workers", monitor)  # type: ignore[arg-type]


@contextlib.contextmanager
def watching_exits(log_dir: str, nproc: int, timeout_s: float) -> Iterator[ExitWatch]:
    """An :class:`ExitWatch` over this launch, and the agent's monitor that counts its ended ranks."""
    with ended_ranks_succeed(), ExitWatch(log_dir, nproc, timeout_s) as watch:
        yield watch
