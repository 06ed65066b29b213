"""How multigpu starts a Python child of its own (a worker, a launcher, the stderr copier): without the
current folder on ``sys.path``.

Why: ``python -m module`` puts the current folder first on ``sys.path``, so a ``json.py``, ``signal.py`` or
``multigpu.py`` in the folder the user starts from would be imported into every rank - code run from a file
someone handed you - or would break the launch ("No module named 'multigpu.launch'": the PyTorch DDP tutorial
series has a ``multigpu.py``). ``python script.py`` and torchrun put the *script's* folder first instead; the
worker does that itself before it runs the script (:func:`multigpu.launch.worker.run_user_code`).

Python 3.11's ``-P`` says "no unsafe path"; for another interpreter (3.10, or one whose version this process
cannot know, such as a Slurm script's ``python``) ``-c`` with a first line that drops the current folder
does the same: ``-c`` puts ``''`` first, and nothing is imported from the path before that line runs
(``sys`` is built in). ``sys.argv`` is then what ``python -m module ARGS`` gives (``runpy``'s ``alter_sys``).
"""

from __future__ import annotations

import sys

#: The first statement of a ``-c`` child: drop the current folder ('' under ``-c``; nothing under ``-P`` or
#: ``PYTHONSAFEPATH``, when there is nothing to drop), then run the module as ``-m`` would.
BOOTSTRAP = (
    "import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; import runpy; "
    "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
)


def python_module(module: str, python: str = sys.executable, unbuffered: bool = False) -> list[str]:
    """``python -m module`` without the current folder on ``sys.path`` (arguments follow it)."""
    options = ["-u"] if unbuffered else []
    if python == sys.executable and sys.version_info >= (3, 11):
        return [python, *options, "-P", "-m", module]
    return [python, *options, "-c", BOOTSTRAP.format(module=module)]
