"""A file beside the user's script that hides a module torch, multigpu or Python itself imports: one line
naming the file, instead of an error deep inside torch.

Why: the worker puts the script's folder first on ``sys.path``, as ``python script.py`` and torchrun do. A
``random.py`` or ``queue.py`` there is then what ``import random`` inside torch finds - under plain
``python`` too, where it ends in an ``AttributeError`` far from the cause. The user's own imports of their
own files are theirs, and so is an unpickler's import of the module a pickled class of theirs names
(``torch.load`` of a checkpoint): only an import made by other code outside that folder (torch, the
standard library, multigpu) of a name that also exists outside it, or is one of the standard library's
(``winreg``, tried inside ``try: ... except ImportError`` on Linux), is refused. Sources, sourceless
``.pyc`` files and extension modules count alike: the path finder imports all three.

How: a finder first on ``sys.meta_path``, installed only when the folder holds such a name at all (one
listing of the folder at start-up; none for almost every script), that looks at the frame doing the
import. Names imported before the script runs (``json``, ``signal``, ``multigpu`` itself) are never looked
up again, so a ``multigpu.py`` beside the script - the PyTorch DDP tutorial series has one - changes nothing.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from types import FrameType, ModuleType
from typing import Any, Optional, Sequence

from multigpu.errors import LaunchError, visible

#: Frames of the import machinery itself, between the importing line and the finder.
_MACHINERY = ("<frozen importlib", os.path.dirname(importlib.machinery.__file__) + os.sep)


#: What the path finder imports from a folder: sources, sourceless bytecode, extension modules.
_SUFFIXES = tuple(sorted(importlib.machinery.all_suffixes(), key=len, reverse=True))


def _own_names(folder: str) -> dict[str, str]:
    """name -> file for the modules and packages ``folder`` holds (``x.py``, ``x.pyc``, ``x.*.so``,
    ``x/__init__.py``)."""
    found: dict[str, str] = {}
    try:
        entries = os.listdir(folder)
    except OSError:
        return found
    for entry in entries[:100_000]:
        path = os.path.join(folder, entry)
        suffix = next((s for s in _SUFFIXES if entry.endswith(s)), None)
        if suffix is not None and entry[: -len(suffix)].isidentifier():
            found.setdefault(entry[: -len(suffix)], path)
        elif entry.isidentifier() and os.path.isfile(os.path.join(path, "__init__.py")):
            found[entry] = os.path.join(path, "__init__.py")
    return found


class ShadowGuard:
    """The finder (see the module's docstring): refuses a library's import that would load a user's file."""

    def __init__(self, folder: str, names: dict[str, str], script: str) -> None:
        # "/x/" (and "/" for a script in /)
        self.folder = os.path.join(os.path.realpath(folder), "")
        self.names = names
        self.script = script

    def find_spec(
        self, name: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Any:
        # a submodule, or not one of the folder's names
        if path is not None or name not in self.names:
            return None
        if name in sys.builtin_module_names:  # found before any file
            return None
        importer = _importer(sys._getframe(1))
        if importer is None or importer.f_code.co_filename.startswith("<"):
            return None  # generated code: not ours to judge
        where = os.path.realpath(importer.f_code.co_filename)
        if where.startswith(self.folder) or _unpickling(importer):
            # the user's own import of their own file, or of the module of a class in their pickle
            return None
        elsewhere = [
            p for p in sys.path if os.path.join(os.path.realpath(p or "."), "") != self.folder
        ]
        if (
            name not in sys.stdlib_module_names
            and importlib.machinery.PathFinder.find_spec(name, elsewhere) is None
        ):
            return None  # only theirs exists
        who = str(importer.f_globals.get("__name__") or os.path.basename(where)).split(".")[0]
        raise LaunchError(
            f"{visible(self.names[name])} beside {visible(os.path.basename(self.script))} hides the module "
            f"{name!r} that {visible(who)} imports.",
            f"rename {visible(os.path.basename(self.names[name]))} (and your imports of it): a file beside the "
            "script is what `import " + name + "` finds first, as under python and torchrun.",
        )


def _unpickling(frame: FrameType) -> bool:
    """The import is an unpickler's, for the module a pickled class names (``torch.load`` of a checkpoint
    that holds one of the user's classes): the user's data, as under python."""
    for _ in range(4):
        if frame.f_code.co_name in ("find_class", "load_global", "_instantiate"):
            return True
        if frame.f_back is None:
            return False
        frame = frame.f_back
    return False


def _importer(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The frame whose code is doing the import (the first outside the import machinery)."""
    while frame is not None and frame.f_code.co_filename.startswith(_MACHINERY):
        frame = frame.f_back
    return frame


def guard(folder: str, script: str) -> None:
    """Install a :class:`ShadowGuard` for ``folder`` if it holds any name found elsewhere too."""
    names = {
        name: path
        for name, path in _own_names(folder).items()
        if name not in sys.modules and os.path.realpath(path) != os.path.realpath(script)
    }
    if names:
        sys.meta_path.insert(0, ShadowGuard(folder, names, script))
