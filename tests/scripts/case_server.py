"""A fork server for the hostile-input table: ``python -m multigpu ARGS`` without paying for a new
interpreter and ``import torch`` per case.

Why: the table runs ~150 command lines; each used to cost an interpreter start and the imports (~1 s
here), most of the table's time. This process imports multigpu and torch once, then forks one child
per case (a ``multigpu run`` case ``exec``s a new interpreter: see ``LAUNCHING``). The child does what
``python -m multigpu ARGS`` does - in the case's folder, with the case's environment, stdin on
/dev/null (this process's stdin carries the requests), its stdout and stderr going to files - and exits
with the command's status. The parent
never runs torch code, so forking it is safe. Processes the command itself starts are real ones.

A request with ``"python": true`` runs ``python ARGV`` instead (``-c CODE``, ``-m MODULE`` or a script,
with what a new interpreter would put first on ``sys.path``): an uncaught exception sets ``sys.last_*``
and goes to ``sys.excepthook`` (multigpu's one-line hook, as in a new interpreter that imported
multigpu), then threads are joined and the exit handlers run, as at an interpreter's exit. The table
keeps a few such cases in a real interpreter of their own, so that path stays proven too.

Protocol: one JSON object per line on stdin - ``{"id": N, "argv": [...], "cwd": ..., "env": {...}, "out":
path, "err": path, "timeout": seconds, "python": bool}`` - and one JSON line back:
``{"id": N, "status": N, "seconds": S, "cpu_s": C}`` (status -9 when the case ran past its timeout and was
killed with its process group; C: the CPU seconds of the case and of the processes it waited for).
"""

import atexit
import gc
import json
import os
import runpy
import signal
import sys
import threading
import time
import types
from typing import Callable

import torch  # noqa: F401 - imported once here, inherited by every case that does not launch

import multigpu.cli  # noqa: F401
from multigpu.launch.interpreter import python_module

#: Commands that launch workers in their own process: a case of one runs in a new interpreter, as a
#: user's would.
LAUNCHING = ("run",)


def as_interpreter(main: Callable[[], object]) -> int:
    """Run ``main`` as an interpreter runs its program, in this forked process: the exit status a
    ``SystemExit`` carries (a message on stderr, status 1), an uncaught exception to ``sys.last_*`` and
    ``sys.excepthook`` (multigpu's one-line hook), status 1; then what an interpreter does at exit - join
    the threads, run the exit handlers, flush the streams. The caller leaves with ``os._exit(status)``."""
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


def run_python(argv: list) -> int:
    """``python ARGV`` in this (forked) process: its status, as the interpreter would exit with it
    (:func:`as_interpreter`: the exit status, the hook, threads, exit handlers). The exit
    handlers this server registered stay: they are the ones importing torch registers, which a case that
    imports torch would have (and cannot register again: the modules are imported)."""

    def main() -> None:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            module = types.ModuleType("__main__")
            sys.modules["__main__"] = module
            exec(compile(argv[1], "<string>", "exec"), module.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # the script's path as the interpreter gives it: absolute
            script = os.path.abspath(argv[0])
            sys.argv = [argv[0], *argv[1:]]
            runpy.run_path(script, run_name="__main__")

    code = as_interpreter(main)
    gc.collect()  # and finalisation: objects' finalizers (files flushed) before os._exit
    return code


def run_case(request: dict) -> tuple[int, float]:
    """(the case's exit status, or -9 when it ran past its timeout; the CPU seconds of the case and of the
    processes it waited for)."""
    pid = os.fork()
    if pid == 0:  # the case
        try:
            # as a new interpreter has it (main() set ours)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.setpgid(0, 0)  # its own process group: a timeout kills everything it started
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            # What a fresh `python -m` would have on its path: the current folder, then PYTHONPATH.
            extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            first = os.getcwd()
            # what `python ARGV` puts first: '' for -c, the script's folder for a script
            if request.get("python"):
                argv = request["argv"]
                first = (
                    ""
                    if argv[:1] == ["-c"]
                    else os.getcwd()
                    if argv[:1] == ["-m"]
                    else os.path.dirname(os.path.realpath(argv[0]))
                )
            sys.path[:0] = [first, *extra]
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            for fd, path in ((1, request["out"]), (2, request["err"])):
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(target, fd)
                os.close(target)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            if (
                not request.get("python")
                and request["argv"][:1]
                and request["argv"][0] in LAUNCHING
            ):
                os.execve(
                    sys.executable, [*python_module("multigpu"), *request["argv"]], dict(os.environ)
                )
            if request.get("python"):
                code = run_python(request["argv"])
            else:
                sys.argv = ["multigpu", *request["argv"]]
                code = 0
                try:
                    runpy.run_module("multigpu", run_name="__main__", alter_sys=True)
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                except BaseException:  # what `python -m multigpu` would do: a traceback, status 1
                    import traceback

                    traceback.print_exc()
                    code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            pass
        os._exit(code)
    deadline = time.monotonic() + request.get("timeout", 30)
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            usage = os.wait4(pid, 0)[2]
            return -9, usage.ru_utime + usage.ru_stime
        time.sleep(0.005)


def main() -> None:
    # Stopped (SIGTERM, Ctrl-C) or its client gone (end of stdin): nothing it started outlives it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve()
    except (KeyboardInterrupt, SystemExit):
        pass


def serve() -> None:
    gc.freeze()  # the imports: never scanned in a forked child
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:  # a client interrupted while writing: it has dropped this server
            continue
        started = time.monotonic()
        status, cpu = run_case(request)
        reply = {
            "id": request.get("id"),
            "status": status,
            "seconds": time.monotonic() - started,
            "cpu_s": cpu,
        }
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
