"""A queue's runs started from one import of torch: each run's ``multigpu run`` launcher is forked from a
server the queue starts once, instead of being a new interpreter that imports torch again.

Why: a CPU queue of short runs (a sweep's trials, a rehearsal, a test suite) paid ~2.5 s of CPU per run
importing torch in the run's launcher and ~2 s more importing ``torch._dynamo`` in the launcher's fork
server - often more than the run's own work. Ray Tune's ``reuse_actors`` answers the same cost by
keeping trial processes alive between trials; here every run is still a process of its own, forked fresh
from a process that imported torch and has run nothing of any run.

``multigpu check`` starts its two runs the same way.

How: the queue forks a :class:`.forkserver.ForkServer` (``launchers=True``) from itself when its first run
starts (the queue has no thread of its own; the server imports torch with that run's ``OMP_NUM_THREADS``),
and the server imports torch, ``torch._dynamo`` and the launcher's modules once. A run's command is
``python -m multigpu.launch.boot run FLAGS ...`` with ``MULTIGPU_BOOT_LAUNCHER=1`` (a ~0.1 s process, no
torch) in place of ``python -m multigpu run FLAGS ...``: the boot process hands the server its arguments, environment,
folder and stdin/stdout/stderr, and the server forks a launcher that runs the command as ``python -m
multigpu`` would (:func:`run_launcher`), with ``MULTIGPU_WORKER_START=fork`` - its workers are forked from
the same import (:mod:`.local`). The boot process is what the queue watches and signals: it passes
signals on and leaves with the launcher's exit status. Where the server declines, the boot process
becomes ``python -m multigpu run ...`` itself (``exec``: same pid, only the start-up time lost).

A run starts the plain way (a new interpreter) on GPU slots (a CUDA driver must not be near a fork: not
tried on a GPU yet), with ``MULTIGPU_WORKER_START=plain`` in the queue's or the run's environment, when
its environment differs from the queue's in a variable torch reads at import (an ``env:`` of its own;
an ``OMP_NUM_THREADS`` other than the one the server imported torch with), when the queue imported torch
itself before (with other variables, perhaps) and nothing vouches for that import, or when the queue
had a thread running (a fork copies only the calling thread). A queue with a search (Optuna imports
numpy, which sizes its threads at import) forks only where ``OMP_NUM_THREADS`` is set for it.

What differs from a new interpreter, as for forked workers (:mod:`.forkserver`): every run of one queue has
the queue's string-hash seed (set ``PYTHONHASHSEED`` to choose it), ``/proc/PID/cmdline`` and
``sys.orig_argv`` of a launcher are the queue's, ``sys.modules`` holds what the queue had imported, the
exit handlers the queue had registered (``logging``'s flush) run at a launcher's exit too, and what
the server prints while it imports torch goes nowhere (its stderr is ``/dev/null``: it must not hold the
queue's, or a ``multigpu queue ... | tee`` would wait for the server).

Stopping: the queue's SIGTERM reaches the launcher through its boot process, and the launcher stops its
workers cleanly (they checkpoint); the queue's SIGKILL of a boot process (a run that outlived the grace
time) reaches it as SIGKILL, through the server. When the queue dies, each boot process gets SIGTERM from
the kernel (as a plain run does, ``PR_SET_PDEATHSIG``) and passes it on; the server starts nothing more
and leaves when its launchers have. At the queue's end it is asked to leave the same way, and killed only
if it has not within ``STOP_WAIT_S``. When the server dies, its launchers get SIGTERM and their boot
processes pass later signals to them directly (but the queue's SIGTERM or SIGHUP: a second one would cut
the clean stop short), wait for them to end (a pidfd) and leave with status 143: the queue counts the run
as interrupted, and the next queue resumes it. Not covered: a launcher whose clean stop outlasts the
queue's grace after its server died is not killed with its boot process (nothing is left to pass the
SIGKILL on); it ends when its stop does.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading
from typing import Callable, Mapping, NoReturn, Optional, Sequence

from multigpu.fileio import open_devnull
from multigpu.launch.boot import FORKSERVER_VAR, LAUNCHER_VAR
from multigpu.launch.fork_rules import START_VAR, inheritable_state, start_wish
from multigpu.launch.forkserver import ForkServer

BOOT_MODULE = "multigpu.launch.boot"


#: Imported by the queue already, they sized their thread pools from its environment: a server forked from
#: it cannot take another ``OMP_NUM_THREADS`` for its runs (an Optuna search imports numpy).
SIZED_AT_IMPORT = ("torch", "numpy")


def start_server(keep: Callable[[ForkServer], None], import_env: Optional[Mapping[str, str]] = None) -> None:
    """The launcher server of a queue or ``multigpu check``, handed to ``keep`` (not called: their runs start the
    plain way; why a callback: :meth:`.ForkServer.start`). ``import_env``: variables the server sets before it
    imports torch (the ``OMP_NUM_THREADS`` the queue gives its runs). Where this process imported torch or numpy
    already (a queue with an Optuna search), they sized their threads from this environment: if ``import_env``
    differs from it, no server (every run would be declined; its imports would cost ~5 s of CPU for nothing)."""
    wish = start_wish()
    if wish == "plain" or ("torch" in sys.modules and wish != "fork"):
        return
    if not inheritable_state():
        return
    if any(name in sys.modules for name in SIZED_AT_IMPORT) and \
            any(os.environ.get(k) != v for k, v in (import_env or {}).items()):
        return
    # Its stderr on /dev/null: the server must not hold the queue's (a `| tee` would wait for its launchers)
    devnull = open_devnull()
    try:
        ForkServer.start(keep, launchers=True, import_env=dict(import_env or {}), stderr=devnull)
    finally:
        os.close(devnull)


def through(server: Optional[ForkServer], command: Sequence[str], env: dict[str, str]) -> list[str]:
    """What to start for ``command`` (``python -m multigpu run ...``): the command itself, or - with a
    running server - the boot process that asks the server for its launcher (``env`` gets the socket)."""
    if server is None or not server.running():
        return list(command)
    env[FORKSERVER_VAR], env[LAUNCHER_VAR] = server.path, "1"
    return boot_command(command)


def boot_command(command: Sequence[str]) -> list[str]:
    """``python -m multigpu ARGS`` as the command that asks the server for its launcher (with
    ``MULTIGPU_BOOT_LAUNCHER=1`` in its environment: :func:`through`)."""
    python, flag, module, *args = command
    if (flag, module) != ("-m", "multigpu"):
        raise ValueError(f"not a multigpu command: {' '.join(command)[:200]}")
    return [python, "-m", BOOT_MODULE, *args]


def run_launcher(argv: list[str]) -> NoReturn:
    """In the forked child: ``python -m multigpu ARGV`` as a new interpreter would run it, then leave with
    its status."""
    os.environ[START_VAR] = "fork"  # the server imported torch with this environment: see declines()

    def main() -> None:
        sys.argv = ["multigpu", *argv]
        runpy.run_module("multigpu", run_name="__main__", alter_sys=True)

    os._exit(as_interpreter(main))


def as_interpreter(main: Callable[[], object]) -> int:
    """Run ``main`` as an interpreter runs its program, in a forked process: the exit status a
    ``SystemExit`` carries (a message on stderr, status 1), an uncaught exception to ``sys.last_*`` and
    ``sys.excepthook`` (multigpu's one-line hook; ``Run.close`` reads ``sys.last_*``), status 1; then what
    an interpreter does at exit - join the threads, run the exit handlers, flush the streams. The caller
    leaves with ``os._exit(status)``."""
    code = 0
    try:
        main()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: threads, then handlers
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code
