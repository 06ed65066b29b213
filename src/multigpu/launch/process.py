"""Process plumbing shared by the launcher's workers and the queue's runs: die with the parent; a name;
imports without the garbage collector; stop signals that raise; a launch stopped as its own Ctrl-C would.

Why: a worker whose launcher was SIGKILLed, or a run whose queue died, must not live on as an orphan
holding GPUs. Linux delivers a chosen signal to a child when its parent dies (``PR_SET_PDEATHSIG``);
elsewhere this is a no-op and the parents' own cleanup is all there is.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator, Optional

if TYPE_CHECKING:
    import subprocess

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: ``multigpu run --stop-timeout``'s default: on SIGTERM/SIGUSR1 the workers' seconds to checkpoint before SIGKILL.
STOP_TIMEOUT_S = 120
#: How long a command that started a launch (check, doctor, the queue) waits for it to stop once asked: the
#: workers' default --stop-timeout and 30 s for the launcher itself, so a checkpoint in progress is not cut off.
LAUNCH_STOP_WAIT_S = STOP_TIMEOUT_S + 30


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; True if it took effect."""
    prctl = _prctl()
    return prctl is not None and prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def name_process(name: bytes) -> None:
    """What ``top`` and ``/proc/PID/comm`` show (15 bytes at most; the command line stays as it was).
    A no-op where Linux's ``prctl`` is not there."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


_command_process = False


def mark_command_process() -> None:
    """Called by the ``multigpu`` command's entry point (``cli.entry``) only: this process is the command's
    own, not a user's Python that calls ``multigpu.cli.main`` - whose heap nothing may freeze."""
    global _command_process
    _command_process = True


def is_command_process() -> bool:
    return _command_process


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """No cyclic garbage collection inside the block; the collector is as it was after it. Why: importing
    torch and ``torch._dynamo`` allocates millions of objects that all stay alive, and the collector walked
    them again and again: 3.97 s of CPU with it, 3.49 s without (``import torch, torch._dynamo,
    torch.distributed.launcher.api``, medians of 7 interleaved runs on 2 cores). The launcher and the fork
    server import in this block; a process forked inside it would inherit the paused collector, so none is.

    ``freeze``: everything allocated so far goes to the collector's permanent generation before it comes
    back (``gc.freeze()``), so that no later collection walks it - the first one after the block would walk
    all of it otherwise. Only where this process's own objects are all that is there (the fork server, the
    command's own process: :func:`is_command_process`), never under a caller's heap: its garbage would never
    be collected."""
    was_on = gc.isenabled()
    try:
        gc.disable()
        yield
        if freeze:
            gc.freeze()
    finally:
        if was_on:
            gc.enable()


def parent_of(pid: int) -> int:
    """The parent of process ``pid`` (0 when it cannot be read)."""
    from multigpu.fileio import Folder

    try:
        return int(
            Folder(f"/proc/{pid}").load_text("stat", limit=4096).rsplit(")", 1)[1].split()[1]
        )
    except (OSError, ValueError, IndexError):
        return 0


class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1) that came while :func:`install_stops`' handler was in
    place. A BaseException, as KeyboardInterrupt: an ``except Exception`` (torch's import has some) must not
    swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """The stop signals' handler while the launcher starts: the first stop raises (:class:`Stopped`, or
    what ``raising`` makes: torch's own exception once the launcher is inside torch's agent, which then
    leaves its rendezvous open as for its own handler), later ones are only noted; so are stops while
    ``holding`` (inside :meth:`held`, and while the launcher cleans up), for :meth:`held` to raise. Why a
    flag this handler reads rather than a signal mask: a mask holds for one thread only, and a process's
    signal goes to any thread that does not block it (torch's own, for one), whose C handler has CPython
    run this one in the main thread all the same."""

    def __init__(self) -> None:
        self.holding = False
        self.came: Optional[int] = None
        self.raised = False
        self.raising: Callable[[int], BaseException] = Stopped
        self.claimed = False
        self._lock = threading.RLock()  # (re-entered when a second stop comes inside this handler)

    def __call__(self, signum: int, _frame: object) -> None:
        with self._lock:
            claimed = self.claimed
            if not claimed and self.holding:
                self.came = self.came or signum
                return
            if not claimed:
                self.raised = True
                # one stop ends the start-up; a second waits for its clean-up
                if self.raising is Stopped:
                    # (in torch's agent every stop raises, as torch's own handler does)
                    self.holding = True
        if claimed:  # another thread acts on the stop and ends the process: go no further meanwhile
            threading.Event().wait()
        raise self.raising(signum)

    def claim(self) -> bool:
        """For a thread that acts on a stop the main thread cannot handle (it waits inside C++): True when
        no stop was raised or noted before, and from now on a stop is only noted - handled once, by one."""
        with self._lock:
            if self.raised or self.holding:
                return False
            self.raised = self.holding = self.claimed = True
            return True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A step that must not be cut in two (make a resource, hand it to whoever removes it): a stop signal
        waits until it ends."""
        self.holding = True
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        """Stop holding (:meth:`held`'s end, or a hold that began elsewhere): a stop noted meanwhile raises
        now, once."""
        came, self.came = self.came, None
        self.holding = came is not None
        if came is not None:
            self.raised = True
            raise self.raising(came)


#: The signals torch's agent handles in the launcher (``signals_to_handle``); the first four also while it
#: starts. Slurm sends USR1 before a job's time limit.
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT)
STOPS = AGENT_SIGNALS
Handlers = list[tuple[int, Any]]


def agent_signal_handlers() -> Handlers:
    """The handlers of :data:`AGENT_SIGNALS` now, to put back after the launch (torch's agent never does);
    not one Python cannot see (set from C)."""
    return [
        (sig, handler) for sig in AGENT_SIGNALS if (handler := signal.getsignal(sig)) is not None
    ]


def install_stops(stops: StopSignals, saved: Handlers, holding: bool = False) -> None:
    """``stops`` as the handler of the stop signals in ``saved``, an ignored one too (``cmd &`` in a script
    ignores SIGINT: torch's agent handles it all the same, as torchrun does). Inside the caller's ``try``:
    a signal that comes meanwhile meets one handler or the other, and :func:`restore_stops` puts them all
    back."""
    stops.holding = stops.holding or holding
    for sig, _ in saved:
        if sig in STOPS:
            signal.signal(sig, stops)


def restore_stops(stops: StopSignals, saved: Handlers, deliver: bool = False) -> None:
    """Put ``saved`` back, those that may raise last, every one of them even when one already back raises
    meanwhile (``signal.signal`` runs pending handlers first); then raise that exception. ``deliver``: a
    stop noted meanwhile goes to its own handler (the launch succeeded; otherwise it ended on a stop or a
    failure already, whose exit status must stand)."""
    stops.holding = True
    pending = sorted(saved, key=lambda item: callable(item[1]))
    first: Optional[BaseException] = None
    while pending and threading.current_thread() is threading.main_thread():  # (others set none)
        try:
            while pending:
                signal.signal(*pending[0])
                pending.pop(0)
        except BaseException as exc:  # a handler already back raised: the rest still go back
            first = first or exc
    if first is not None:
        raise first
    if deliver and stops.came is not None:
        signal.raise_signal(stops.came)


@contextlib.contextmanager
def watching_stops(
    stops: StopSignals, act: Callable[[int], None], grace_s: float = 1.0
) -> Iterator[None]:
    """While the main thread may wait inside C++ (a rendezvous's store, for the other nodes: no Python
    handler runs until the wait returns, up to its timeout), a thread acts on a stop that ``stops`` has
    not handled within ``grace_s``: ``act(signum)`` cleans up and ends the process. Why it sees the stop:
    the C part of Python's handler writes the signal's number to the wakeup fd (``signal.set_wakeup_fd``)
    the moment it comes, whichever thread waits. A stop the main thread raises in time (a wait in Python)
    stays its own; so does one after torch's agent took the signals over. Once the thread claimed a
    stop, the main thread goes no further (:meth:`StopSignals.__call__`). Main thread only (a no-op
    elsewhere, where no handler of ours is set); other signals' bytes go on to a wakeup fd set before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = -1

    def watch() -> None:
        while data := _read(read):
            if previous >= 0 and (others := bytes(b for b in data if b not in STOPS)):
                with contextlib.suppress(OSError):
                    os.write(previous, others)
            for signum in data:
                if signum in STOPS and _unhandled(stops, signum, grace_s) and stops.claim():
                    act(signum)

    watcher = threading.Thread(target=watch, name="multigpu-stop-watch", daemon=True)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        watcher.start()
        yield
    finally:  # each step whatever the one before raised (a stop's handler runs between any two)
        try:
            signal.set_wakeup_fd(previous)
        finally:
            os.close(write)  # the watcher reads the end of the pipe and leaves
            try:
                if watcher.ident is not None:
                    watcher.join(grace_s + 1)
            finally:
                if not watcher.is_alive():
                    os.close(read)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 64)
    except OSError:
        return b""


def _unhandled(stops: StopSignals, signum: int, grace_s: float) -> bool:
    """Still ours after ``grace_s``: neither raised by the main thread nor taken over by another handler."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if stops.raised or signal.getsignal(signum) is not stops:
            return False
        time.sleep(0.02)
    return not stops.raised and signal.getsignal(signum) is stops


@contextlib.contextmanager
def stopping_cleanly() -> Iterator[StopSignals]:
    """A command's stop signals raise :class:`Stopped` (the first; later ones wait for its clean-up), so
    its ``finally`` blocks run: SIGTERM's default would end it at once, its children and folders left
    behind. The old handlers are back after the block; a stop noted during a clean-up that ended well goes
    to its own handler then. Main thread only (elsewhere nothing changes)."""
    stops = StopSignals()
    saved = agent_signal_handlers() if threading.current_thread() is threading.main_thread() else []
    done = False
    # An ignored SIGINT or SIGHUP stays ignored (`nohup`, `cmd &`): the runs are in sessions of their own,
    # no terminal's. SIGTERM is taken all the same: the runs must not inherit it ignored (exec resets only a
    # handled one), or neither our stop nor their parent's death would reach them.
    kept = [
        (sig, handler)
        for sig, handler in saved
        if handler is not signal.SIG_IGN or sig not in (signal.SIGINT, signal.SIGHUP)
    ]
    try:
        install_stops(stops, kept)
        yield stops
        done = True
    except Stopped as stopped:
        # a Python program called the command: its own handler gets the stop too
        if not is_command_process():
            stops.came, done = stopped.signum, True
        raise
    finally:
        restore_stops(stops, saved, deliver=done)


def own_session_dying_with_parent() -> Callable[[], None]:
    """A child's ``preexec_fn``: a session of its own (a terminal's Ctrl-C reaches only this process, which
    stops the child gracefully, once) and SIGTERM - a graceful stop - when this process dies; a child whose
    parent died before that took effect leaves at once. Made here, in the parent: the child, forked from a
    process that may have threads, only makes system calls (no ``dlopen``)."""
    parent = os.getpid()
    prctl = _prctl()

    def in_child() -> None:
        os.setsid()
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:
                os._exit(128 + signal.SIGTERM)

    return in_child


@contextlib.contextmanager
def launched(
    argv: list[str],
    stops: StopSignals,
    read: Optional[Callable[[IO[str]], None]] = None,
    **popen: Any,
) -> Iterator[subprocess.Popen[Any]]:
    """A launch (``multigpu run``'s argv) that a command (check, doctor) starts and never leaves behind: in a
    session of its own (:func:`own_session_dying_with_parent`: a terminal's Ctrl-C reaches only the command,
    which stops the launch, once; the command's death stops it too), and whatever leaves the block - a stop
    signal of ``stops`` (:func:`stopping_cleanly`), the caller's own error on a timeout - stops it as that
    signal (SIGTERM for an error) would: see :func:`_stop_launch`. A stop that comes while the launch starts
    waits until it is ours to stop: the block's first statement is ``stops.release()`` (a stop raised
    before the block is entered, in ``__enter__``, would leave the launch running), and a caller that
    raises its own error first sets ``stops.holding`` (a stop in between would leave the block before the
    launch is stopped): CPython runs a signal's handler only at a call, a loop's jump back or a function's
    entry, none of which lies between an ``except`` line and that store. ``read``: its stdout, read
    by a thread of its own from before any stop can land (so the pipe never fills while the launch
    stops), joined for up to 10 s after the block; without it, the pipes are read while it stops."""
    import subprocess

    stops.holding = True
    with subprocess.Popen(argv, preexec_fn=own_session_dying_with_parent(), **popen) as proc:
        reader = (
            None
            if read is None
            else threading.Thread(target=read, args=(proc.stdout,), daemon=True)
        )
        try:
            if reader is not None:
                reader.start()
            yield proc
        except BaseException as exc:
            stops.holding = True  # a second stop waits for this one
            drained = reader is not None and reader.ident is not None  # (started)
            _stop_launch(proc, exc.signum if isinstance(exc, Stopped) else signal.SIGTERM, drained)
            raise
        if reader is not None:
            reader.join(timeout=10)


def _stop_launch(proc: subprocess.Popen[Any], signum: int, drained: bool) -> None:
    """``signum`` to the launch's process group, as a terminal's Ctrl-C or a scheduler's SIGTERM would send
    it, then ``LAUNCH_STOP_WAIT_S`` for the launcher to stop its workers and remove its folders; SIGKILL only
    after that. Its pipes are read meanwhile (a launcher blocked on a full pipe would never stop) unless
    ``drained``."""
    import subprocess

    try:
        if proc.poll() is None:  # (a pid reaped already may be another process's by now)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
        if drained:
            proc.wait(timeout=LAUNCH_STOP_WAIT_S)
        else:
            proc.communicate(timeout=LAUNCH_STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # its group, as the signal went: nothing left holding the pipes we read
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@functools.lru_cache(maxsize=None)
def _prctl() -> Any:
    """Linux's ``prctl``, looked up once (a process forked after that calls it without a ``dlopen``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None


def fresh_random_state() -> None:
    """Random state as a new interpreter would have it (a forked child shares its parent's)."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # torch seeds its default generator from the OS at start-up
    if "multiprocessing" in sys.modules:  # its connections' key, drawn at start-up
        import multiprocessing

        multiprocessing.current_process().authkey = os.urandom(32)
