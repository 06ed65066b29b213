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

With ``--launches`` (the test suite's launch server, ``conftest.multigpu``): a request with ``"launch":
true`` runs ``multigpu run`` (and every other command) in the forked child too, as ``python -m multigpu
ARGS`` would, with ``MULTIGPU_WORKER_START=fork`` so that the launcher forks its workers from the torch this
server imported (``torch._dynamo`` too, and matplotlib's figure for the Trainer's ``curves.png``): a
2-process launch cost ~7 s of CPU in imports, ~2 s this way. That is only right where this server imported
torch with the environment the workers get, so a request whose environment differs from the server's in
anything but ``MULTIGPU_*`` variables (which nothing reads at import), pytest's ``PYTEST_CURRENT_TEST`` and,
with a CPU build of torch, ``CUDA_VISIBLE_DEVICES`` - or that sets ``MULTIGPU_WORKER_START`` itself - starts
a new interpreter instead (``"new_interpreter_for"`` in the reply names the variables). Every launch's
processes are this server's to account for (it is their subreaper): any still alive 15 s after the command
ended is killed with what it started, and named in the reply (``"left"``: pid, name, command line; a forked
process shows this server's command line). Python's, numpy's and torch's random state is drawn again in each
child, as a new interpreter would; the string-hash seed is this server's for every launch.

Protocol: one JSON object per line on stdin - ``{"id": N, "argv": [...], "cwd": ..., "env": {...}, "out":
path, "err": path, "timeout": seconds, "python": bool, "launch": bool}`` - and one JSON line back:
``{"id": N, "status": N, "seconds": S, "cpu_s": C}`` (status -9 when the case ran past its timeout and was
killed with its process group; C: the CPU seconds of the case and of the processes it waited for), and
with ``--launches`` ``"left"`` and ``"new_interpreter_for"``.
"""

import contextlib
import gc
import json
import os
import runpy
import signal
import sys
import time
import types

import torch  # noqa: F401 - imported once here, inherited by every case that does not launch

import multigpu.cli  # noqa: F401
from multigpu.launch.launchers import as_interpreter

#: Commands that launch workers in their own process: a case of one runs in a new interpreter, as a
#: user's would. A launcher that finds torch imported already starts its workers the plain way (the
#: variables torch reads at import were other ones then), each importing torch again.
LAUNCHING = ("run",)
#: ``--launches``: the environment torch was imported with (see the module's docstring).
LAUNCHES = "--launches" in sys.argv[1:]
IMPORT_ENV = dict(os.environ)
#: What a launched process may leave behind for this long after its command ended (the fork server
#: leaves when its launcher has: a signal, then its own exit).
GRACE_S = 15.0
if LAUNCHES:
    import ctypes

    import torch._dynamo  # noqa: F401 - what a launcher's fork server would import for its workers

    try:  # what rank 0 of every Trainer imports to draw curves.png at the end of fit (~0.7 s each)
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except Exception:  # the plot extra is optional, and a matplotlib that cannot start must not stop the server
        pass
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: a launch's orphans become ours
#: A config folder matplotlib made for itself (None: it had a writable one, the usual case).
MPL_TEMPORARY = None
if LAUNCHES and os.environ.get("MPLCONFIGDIR") != IMPORT_ENV.get("MPLCONFIGDIR"):
    # No writable config folder: matplotlib made a temporary one and registered its removal at exit, which every
    # forked child would run (the first to leave would remove it under the others). This server removes it.
    import atexit
    import shutil

    atexit.unregister(shutil.rmtree)
    MPL_TEMPORARY = os.environ.pop("MPLCONFIGDIR")


def import_env_changes(env: dict) -> list[str]:
    """The variables by which ``env`` differs from the one torch was imported with here, leaving out what
    nothing reads at import: ``MULTIGPU_*`` (but the worker start), pytest's ``PYTEST_CURRENT_TEST`` and,
    with a CPU build of torch, ``CUDA_VISIBLE_DEVICES`` (the tests hide GPUs per test, module fixtures not).
    Empty: a launcher forked from here may fork its workers from this import of torch."""
    changed = {k for k in IMPORT_ENV.keys() | env.keys() if IMPORT_ENV.get(k) != env.get(k)}
    if torch.version.cuda is None and torch.version.hip is None:
        changed.discard("CUDA_VISIBLE_DEVICES")
    return sorted(k for k in changed if not (k.startswith("MULTIGPU_") and k != "MULTIGPU_WORKER_START")
                  and k != "PYTEST_CURRENT_TEST")


def reseed() -> None:
    """The random state a new interpreter starts with (a forked child would share this server's)."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch.seed()


def run_python(argv: list) -> int:
    """``python ARGV`` in this (forked) process: its status, as the interpreter would exit with it
    (multigpu.launch.launchers.as_interpreter: the exit status, the hook, threads, exit handlers). The exit
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
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a new interpreter has it (main() set ours)
            os.setpgid(0, 0)  # its own process group: a timeout kills everything it started
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            # What a fresh `python -m` would have on its path: the current folder, then PYTHONPATH.
            extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            first = os.getcwd()
            if request.get("python"):  # what `python ARGV` puts first: '' for -c, the script's folder for a script
                argv = request["argv"]
                first = "" if argv[:1] == ["-c"] else os.getcwd() if argv[:1] == ["-m"] else \
                    os.path.dirname(os.path.realpath(argv[0]))
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
            if LAUNCHES and request.get("launch") and not request.get("python") and \
                    not import_env_changes(request["env"]) and "MULTIGPU_WORKER_START" not in request["env"]:
                reseed()
                os.environ["MULTIGPU_WORKER_START"] = "fork"
                code = run_python(["-m", "multigpu", *request["argv"]])
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            if (not request.get("python") and request["argv"][:1] and request["argv"][0] in LAUNCHING) or \
                    request.get("launch"):
                os.execve(sys.executable, [sys.executable, "-m", "multigpu", *request["argv"]], dict(os.environ))
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
        time.sleep(0.02 if LAUNCHES else 0.005)


def orphans() -> list[int]:
    """This server's children that are alive (a launch's processes, once their parent has gone)."""
    while True:  # reap the ones that ended
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    found, me = [], str(os.getpid())
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if parent == me and state != "Z":
                found.append(int(entry))
    return found


def left_behind() -> list[str]:
    """Wait up to GRACE_S for the processes a launch left to end; kill and name the ones that did not, and
    theirs (each killed one's children become ours in turn), until none is left."""
    deadline = time.monotonic() + GRACE_S
    while (alive := orphans()) and time.monotonic() < deadline:
        time.sleep(0.05)
    named: list[str] = []
    while alive:
        for pid in alive:
            try:
                with open(f"/proc/{pid}/comm") as comm, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    named.append(f"{pid} ({comm.read().strip()}): "
                                 + cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip())
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        time.sleep(0.05)
        alive = [pid for pid in orphans() if time.monotonic() < deadline + GRACE_S]  # their children: ours now
    return named


def main() -> None:
    # Stopped (SIGTERM, Ctrl-C) or its client gone (end of stdin): nothing it started outlives it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        if LAUNCHES:
            for child in orphans():
                with contextlib.suppress(OSError):
                    os.killpg(child, signal.SIGKILL)
            left_behind_now()
        if MPL_TEMPORARY is not None:
            import shutil

            shutil.rmtree(MPL_TEMPORARY, ignore_errors=True)


def left_behind_now() -> None:
    """Every process this server still has, killed at once (its own exit)."""
    while alive := orphans():
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def serve() -> None:
    gc.freeze()  # the imports: never scanned in a forked child (as the product's fork server does)
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:  # a client interrupted while writing: it has dropped this server
            continue
        started = time.monotonic()
        status, cpu = run_case(request)
        reply = {"id": request.get("id"), "status": status, "seconds": time.monotonic() - started, "cpu_s": cpu}
        if LAUNCHES:
            reply["left"] = left_behind()
            reply["new_interpreter_for"] = import_env_changes(request["env"])
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
