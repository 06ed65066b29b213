"""When a process may be forked from a fork server (:mod:`.forkserver`) rather than started as a new
interpreter: the rules, apart from the mechanism.

A forked process keeps what its server did at start-up: the variables torch read when it was imported,
the modules on ``sys.modules``. So a worker (or a queue's launcher, :mod:`.launchers`) is forked only
where a new interpreter would have done the same: its environment differs from the server's only in what
nothing reads at import (:func:`declines`), and nothing beside its script has the name of a module the
server imported already (:func:`shadows`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from multigpu.errors import LaunchError

#: What torch's agent sets per rank: these may differ between the server's environment and a worker's.
PER_WORKER = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})
#: ``plain``: every worker starts the ordinary way (comparisons, a way out); ``fork``: see start_forkserver.
START_VAR = "MULTIGPU_WORKER_START"


def start_wish() -> Optional[str]:
    """``MULTIGPU_WORKER_START`` as set: None (unset or empty), ``fork`` or ``plain``. Anything else is an
    error: a misspelt ``plain`` must not quietly mean the default."""
    value = os.environ.get(START_VAR) or None
    if value in (None, "fork", "plain"):
        return value
    raise LaunchError(f"{START_VAR}={str(value)[:40]!r} is not a way to start workers.",
                      f"set {START_VAR} to plain (every worker a new interpreter) or fork, or unset it.")


#: What a launch sets that torch does not read at import (its workers read it when they run).
READ_AT_RUN_TIME = ("MULTIGPU_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def read_at_import(name: str) -> bool:
    """Whether a variable may count when torch is imported: all but :data:`READ_AT_RUN_TIME` and
    ``CUDA_VISIBLE_DEVICES`` (read when CUDA starts, which never happens in a server or a launcher)."""
    return not name.startswith(READ_AT_RUN_TIME) and name != "CUDA_VISIBLE_DEVICES"


def declines(server_env: dict[str, Any], worker_env: dict[str, Any], launcher: bool = False) -> Optional[str]:
    """Why a worker with ``worker_env`` must start the plain way (None: it may be forked). ``launcher``: a
    queue's run (``multigpu run``) instead, whose environment may differ in what nothing reads at import:
    ``MULTIGPU_*`` (its run's folder and name) and ``CUDA_VISIBLE_DEVICES`` (read when CUDA starts, which
    never happens in the server); ``MULTIGPU_WORKER_START=plain`` is a run's wish to start the plain way (and
    any other value but ``fork`` one the plain start refuses with its one line)."""
    if launcher:
        changed = sorted(k for k in server_env.keys() | worker_env.keys() if server_env.get(k) != worker_env.get(k)
                         and read_at_import(k))
        if worker_env.get(START_VAR) not in (None, "", "fork"):  # plain, or a value the plain start refuses
            changed.append(START_VAR)
    else:
        changed = sorted(k for k in server_env.keys() | worker_env.keys()
                         if server_env.get(k) != worker_env.get(k) and k not in PER_WORKER
                         and not k.startswith("TORCHELASTIC_"))
    return f"its environment differs in {', '.join(changed[:5])}" if changed else None


def shadows(request: dict[str, Any]) -> Optional[str]:
    """The folder the worker puts first on ``sys.path`` (the script's, or the current one for ``-m``)
    holds a module the server has imported already (``profile.py``, ``statistics.py``, ``torch/``...):
    a new interpreter would import the user's file, a forked worker would keep ours."""
    argv = request["argv"]
    folder = request["cwd"] if not argv or argv[0] == "-m" or request.get("kind") == "launcher" else \
        os.path.dirname(os.path.join(request["cwd"], argv[0]))
    try:
        names = os.listdir(folder)
    except OSError:
        return "its folder cannot be listed"
    loaded = {name.partition(".")[0] for name in sys.modules}
    found = sorted(name for name in names if name.partition(".")[0] in loaded and (
        name.endswith((".py", ".so")) or os.path.isfile(os.path.join(folder, name, "__init__.py"))))
    return f"{', '.join(found[:3])} beside it has the name of a module torch imported" if found else None


def inheritable_state() -> bool:
    """This process's own state is one a forked worker or launcher may inherit: no interpreter option other
    than ``-u`` (a plain start has none), no tracer or profiler (coverage, a debugger)."""
    return not (interpreter_options() - {"-u"}) and sys.gettrace() is None and sys.getprofile() is None


def interpreter_options() -> set[str]:
    """The options this interpreter was started with (``python -O -X dev -m multigpu``: -O, -X dev); a
    plain worker is started without them, and a forked one would keep what they did."""
    options, argv = set(), sys.orig_argv[1:]
    while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c", "-", "--"):
        option = argv.pop(0)
        if option in ("-W", "-X") and argv:
            option += " " + argv.pop(0)
        options.add(option)
    return options
