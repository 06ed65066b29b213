"""The first code a launched worker runs: the user's script, then a clean exit with its real status.

Why a wrapper: a worker whose interpreter tears down with live process-group threads sometimes aborts
("terminate called without an active exception") after a successful run. Measured here with torch
2.13 on gloo: 19 of 40 two-process launches aborted when nothing was destroyed, 0 of 40 with
barrier + destroy. This wrapper runs the script, runs the atexit handlers (``mg.init()`` registered
its barrier + destroy there), flushes, and leaves with ``os._exit`` and the script's own status, so
C++ static destructors never run. It also:

- copies its stderr, untouched, to the launcher's terminal and to a per-rank file (:mod:`.tee`), and its
  stdout too when the user named the log folder (``--log-dir``, as torchrun's ``--tee 3``);
- reports a :class:`MultiGPUError` to the launcher (which prints it once for all ranks) instead of
  printing it on every rank, and prints other errors' tracebacks without this wrapper's own frames;
- ends the worker if its launcher dies (no orphans, even after SIGKILL of the agent).

- dumps its threads' Python stacks on SIGUSR2 once its script has ended, for the launcher's watch over a
  worker that does not exit (:mod:`.exit_watch`).

Usage (by the launcher): ``python -u -P -m multigpu.launch.worker script.py args...`` or ``-m pkg.mod args...``
(``-P``: the current folder is not on ``sys.path``; the script's folder is put there, as ``python script.py``
puts it: :mod:`.interpreter`).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import fcntl
import gc
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Optional

from multigpu.distributed.job import Workers
from multigpu.distributed.world import read_job
from multigpu.errors import MultiGPUError
from multigpu.fileio import Folder, open_devnull
from multigpu.launch.attempts import lost_a_peer, record_path, write_record
from multigpu.launch.exit_watch import STACKS_SIGNAL
from multigpu.launch.interpreter import python_module
from multigpu.launch.process import die_with_parent

_TEES: "dict[int, subprocess.Popen[bytes]]" = {}  # fd -> its copier


def stream_log_path(log_dir: str, rank: int, attempt: int, stream: str = "stderr") -> str:
    """Where rank ``rank``'s ``stream`` (stderr, stdout) of restart ``attempt`` is kept (the launcher
    reads stderr back for its failure report)."""
    return os.path.join(log_dir, f"rank{rank}.attempt{attempt}.{stream}")


def launched_by() -> Workers:
    """What ``multigpu run`` told its workers (its job's ``workers`` section; none for torchrun's, or one
    set wrongly by hand - ``mg.init`` names that in its one line)."""
    try:
        return read_job().workers or Workers()
    except MultiGPUError:
        return Workers()


def die_with_launcher() -> None:
    """Ask Linux to SIGKILL this worker when the agent that started it dies."""
    expected = launched_by().agent_pid
    if not expected or not die_with_parent(signal.SIGKILL):
        return
    if os.getppid() != expected:  # the launcher died before prctl took effect
        os._exit(1)


def _above_standard(*fds: int) -> list[int]:
    """``fds`` moved to 3 or above: with stdin closed a new pipe takes fd 0, which the copier's
    ``stdin=DEVNULL`` would then replace."""
    moved = []
    for fd in fds:
        if fd <= 2:
            fd, old = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3), fd
            os.close(old)
        moved.append(fd)
    return moved


def _tee_streams() -> None:
    """stderr always (the failure report reads it), stdout when the user named the log folder."""
    workers = launched_by()
    if not workers.log_dir:
        return
    if workers.keep_stdout:  # first: its copier must not hold stderr's pipe open
        _tee(1, workers.log_dir, "stdout", False)
    _tee(2, workers.log_dir, "stderr", workers.tee_prefix)


def _tee(fd: int, log_dir: str, stream: str, prefixed: bool) -> None:
    """Send ``fd`` through a pseudo-terminal (or a pipe when it is not a terminal) read by a small
    copier process: the terminal sees the bytes unchanged, the file keeps a copy."""
    path = stream_log_path(
        log_dir,
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        stream,
    )
    try:
        Folder(log_dir).create()
        if os.isatty(fd):
            import pty
            import termios
            import tty

            reader, writer = _above_standard(*pty.openpty())
            tty.setraw(writer)  # no newline translation: the bytes arrive as written
            try:
                size = fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8)
                # bars size themselves to the real terminal
                fcntl.ioctl(writer, termios.TIOCSWINSZ, size)
            except OSError:
                pass
        else:
            reader, writer = _above_standard(*os.pipe())
        group = (
            f"group{os.environ['REPLICA_GROUP_ID']} " if os.environ.get("REPLICA_GROUP_ID") else ""
        )
        # (--tee-prefix: stderr's)
        prefix = f"[{group}rank{os.environ.get('RANK', '0')}]: " if prefixed else ""
        terminal = os.dup(fd)
        _TEES[fd] = subprocess.Popen(
            [
                *python_module("multigpu.launch.tee"),
                str(reader),
                path,
                *([prefix] if prefix else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=terminal,
            pass_fds=(reader,),
            close_fds=True,
        )
        os.close(reader)
        os.close(terminal)
        (sys.stderr if fd == 2 else sys.stdout).flush()
        os.dup2(writer, fd)
        os.close(writer)
    except OSError:
        return  # no copy for the failure report: the worker runs anyway


def _record_error(exc: BaseException, one_line: str = "") -> None:
    """Write torch elastic's error file: the launcher orders failures by it and prints ``one_line``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": one_line or f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc))[-20000:],
                "timestamp": str(int(time.time())),
                "multigpu_error": one_line,
            },
        }
    }
    try:
        where = Path(path)
        Folder(where.parent).write_atomic(where.name, json.dumps(data))
    except OSError:
        pass


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


_OWN_FILES = (os.path.abspath(__file__), os.path.abspath(runpy.__file__))


def print_user_traceback(exc: BaseException) -> None:
    """The traceback as ``python script.py`` would print it: this wrapper's and runpy's frames dropped."""
    tb = exc.__traceback__
    while tb is not None and (
        os.path.abspath(tb.tb_frame.f_code.co_filename) in _OWN_FILES
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def run_user_code(argv: list[str]) -> int:
    """Run the script or module as ``__main__``; return the status it would have exited with."""
    from multigpu.launch.shadowing import guard

    if not argv:
        print(
            "usage: python -m multigpu.launch.worker (script.py | -m module) [args...]",
            file=sys.stderr,
        )
        return 2
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            # a user's module, as `python -m` finds it (not one of ours)
            if not argv[1].startswith("multigpu."):
                sys.path.insert(0, os.getcwd())
                guard(os.getcwd(), argv[1])
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            # a linked script's own folder, as python has it
            folder = os.path.dirname(os.path.realpath(script))
            sys.path.insert(0, folder)  # as `python script.py` would (never the current folder)
            guard(folder, script)
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc.code)
    except MultiGPUError as exc:
        _record_error(exc, exc.one_line())
        _show_line(exc.one_line())
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        line = out_of_memory_line(exc)
        _record_error(exc, line)
        if not line and _under_launcher() and lost_a_peer(f"{type(exc).__name__}: {exc}"):
            # Not the cause: another rank went away. The traceback goes to this rank's log only; the
            # launcher names the rank that failed first.
            _append_to_rank_log("".join(traceback.format_exception(exc)))
            print(
                f"multigpu: rank {os.environ.get('RANK', '0')} lost contact with another rank "
                f"({type(exc).__name__}); the launcher names the rank that failed first",
                file=sys.stderr,
            )
            return 1
        print_user_traceback(exc)
        if line:
            _show_line(line)
        return 1


def _under_launcher() -> bool:
    return bool(launched_by().agent_pid and os.environ.get("TORCHELASTIC_ERROR_FILE"))


def _show_line(line: str) -> None:
    """Our one error line: under the launcher into the rank's log (the launcher prints it once for all
    ranks), else on stderr."""
    if _under_launcher():
        _append_to_rank_log(line)
    else:
        print(line, file=sys.stderr)


def out_of_memory_line(exc: BaseException) -> str:
    """For CUDA's out-of-memory error (also when another exception wraps it, as torch.compile's do), the
    line that says what to change - and, in a packed queue run, the share it runs in; '' for anything else."""
    seen: set[int] = set()
    cause: Optional[BaseException] = exc
    while (
        cause is not None and id(cause) not in seen and type(cause).__name__ != "OutOfMemoryError"
    ):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if cause is None or type(cause).__name__ != "OutOfMemoryError":
        return ""
    try:
        share = read_job().memory_fraction
    except MultiGPUError:
        share = None
    if share:  # the same words on every rank: the launcher prints them once
        return MultiGPUError(
            f"out of GPU memory in a packed queue run, which may use {share:.6g} of the GPU.",
            "give this run more of the GPU (gpus: 1, or a lower --runs-per-gpu), or lower its batch size.",
        ).one_line()
    return MultiGPUError(
        "out of GPU memory.",
        "lower the per-process batch size (raise accumulate to keep the global batch), use "
        "precision=bf16, or shard the model (strategy fsdp).",
    ).one_line()


def _append_to_rank_log(line: str) -> None:
    log_dir = launched_by().log_dir
    if not log_dir:
        print(line, file=sys.stderr)
        return
    path = Path(
        stream_log_path(
            log_dir,
            int(os.environ.get("RANK", "0")),
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )
    )
    try:
        with Folder(log_dir).open_append(path.name) as handle:
            handle.write(line + "\n")
    except OSError:
        print(line, file=sys.stderr)


def finish(code: int) -> None:
    """Release the script's objects, run atexit handlers (process-group teardown), flush, exit hard.

    A failing script leaves ``sys.last_value`` set, as Python does for an uncaught exception, so the
    teardown skips its goodbye barrier (the other ranks are not coming).
    """
    sys.last_type = sys.last_traceback = None
    sys.last_value = SystemExit(code) if code else None
    # what the interpreter does first at its exit: wait for the script's own (non-daemon) threads and
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # concurrent.futures' pending work, then the handlers
    except BaseException:
        traceback.print_exc()
    gc.collect()  # close files the script left open, so nothing buffered is lost
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    _drain_tee()
    _drop_unused_stacks()
    os._exit(code)


def _drain_tee() -> None:
    """Close our ends of the stream copies and let the copiers finish, so the launcher reads whole logs."""
    if not _TEES:
        return
    try:
        devnull = open_devnull()
        for fd in _TEES:
            os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        return
    deadline = time.monotonic() + 2  # one wait for all copiers, not one each
    for copier in _TEES.values():
        try:
            copier.wait(timeout=max(0.0, deadline - time.monotonic()))
        # a child of the script still holds the stream: do not wait for it
        except subprocess.TimeoutExpired:
            copier.kill()
        except OSError:
            pass


def _where() -> tuple[Optional[str], int, int]:
    """(log folder, rank, attempt) of this worker."""
    return (
        launched_by().log_dir,
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )


def _announce_node() -> None:
    """Under a c10d rendezvous the node numbers are handed out when every node has joined: the first
    worker of each node says which one it got (the launcher could not know it in advance)."""
    if not launched_by().announce_node or os.environ.get("LOCAL_RANK") != "0":
        return
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    print(
        f"multigpu: this machine is node {os.environ.get('GROUP_RANK', '?')} of "
        f"{os.environ.get('GROUP_WORLD_SIZE', '?')} (ranks {rank}-{rank + local - 1})",
        file=sys.stderr,
        flush=True,
    )


def stacks_on_request(log_dir: Optional[str], rank: int, attempt: int) -> None:
    """From now on (the script has ended) SIGUSR2 writes every thread's Python stack to
    ``rankR.attemptK.stacks``, without the GIL (:mod:`.exit_watch` asks when this worker does not exit)."""
    if not log_dir:
        return
    path = record_path(log_dir, rank, attempt, "stacks")
    try:
        handle = Folder(log_dir).open_append(path.name)
    except OSError:
        return
    global _STACKS
    _STACKS = (handle, path)  # faulthandler writes to its descriptor: open until the process ends
    faulthandler.register(STACKS_SIGNAL, file=handle, all_threads=True, chain=False)


_STACKS: "tuple[IO[str], Path] | None" = None


def _drop_unused_stacks() -> None:
    """Leaving normally: the stacks file nobody asked for goes (a kept --log-dir holds only what happened)."""
    if _STACKS is None:
        return
    handle, path = _STACKS
    try:
        if os.fstat(handle.fileno()).st_size == 0:
            Folder(path.parent).remove(path.name)
    except OSError:
        pass


def _one_line_in_threads(args: "threading.ExceptHookArgs") -> None:
    """A MultiGPUError raised in one of the script's threads (a file that hides a module, imported there)
    is its one line, as on the main thread; anything else gets Python's own report."""
    if isinstance(args.exc_value, MultiGPUError):
        print(args.exc_value.one_line(), file=sys.stderr, flush=True)
    else:
        threading.__excepthook__(args)


def main(argv: Optional[list[str]] = None) -> None:
    die_with_launcher()
    _tee_streams()
    log_dir, rank, attempt = _where()
    me = os.getpid()
    write_record(log_dir, rank, attempt, "pid", me)
    _announce_node()
    threading.excepthook = _one_line_in_threads
    code = run_user_code(sys.argv[1:] if argv is None else argv)
    if os.getpid() != me:  # a process the script forked, leaving through here: not this rank's end
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    write_record(log_dir, rank, attempt, "exit", code)
    stacks_on_request(log_dir, rank, attempt)
    finish(code)


if __name__ == "__main__":
    main()
