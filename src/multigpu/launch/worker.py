"""The first code a launched worker runs: the user's script, then a clean exit with its real status.

Why a wrapper: a worker whose interpreter tears down with live process-group threads sometimes aborts
("terminate called without an active exception") after a successful run. Measured here with torch
2.13 on gloo: 19 of 40 two-process launches aborted when nothing was destroyed, 0 of 40 with
barrier + destroy. This wrapper runs the script, runs the atexit handlers (``mg.init()`` registered
its barrier + destroy there), flushes, and leaves with ``os._exit`` and the script's own status, so
C++ static destructors never run. It also prints a :class:`MultiGPUError` as one line, not a
traceback, and ends the worker if its launcher dies (no orphans, even after SIGKILL of the agent).

Usage (by the launcher): ``python -u -m multigpu.launch.worker script.py args...`` or ``-m pkg.mod args...``
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import signal
import sys
import traceback


def _die_with_launcher() -> None:
    """Ask Linux to SIGKILL this worker when the agent that started it dies."""
    expected = os.environ.get("MULTIGPU_AGENT_PID")
    if not expected or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != expected:  # the launcher died before prctl took effect
        os._exit(1)


def _record_error(exc: BaseException) -> None:
    """Write torch elastic's error file so the launcher orders failures by when they happened."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    except Exception:
        pass


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_user_code(argv: list[str]) -> int:
    """Run the script or module as ``__main__``; return the status it would have exited with."""
    from multigpu.errors import MultiGPUError

    if not argv:
        print("usage: python -m multigpu.launch.worker (script.py | -m module) [args...]", file=sys.stderr)
        return 2
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(script)  # as `python script.py` would
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc.code)
    except MultiGPUError as exc:
        _record_error(exc)
        print(exc.one_line(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        _record_error(exc)
        traceback.print_exc()
        return 1


def finish(code: int) -> None:
    """Release the script's objects, run atexit handlers (process-group teardown), flush, exit hard.

    A failing script leaves ``sys.last_value`` set, as Python does for an uncaught exception, so the
    teardown skips its goodbye barrier (the other ranks are not coming).
    """
    sys.last_type = sys.last_traceback = None
    sys.last_value = SystemExit(code) if code else None
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
    os._exit(code)


def main() -> None:
    _die_with_launcher()
    code = run_user_code(sys.argv[1:])
    finish(code)


if __name__ == "__main__":
    main()
