"""torch's C++ log level in the launcher, lowered after torch has loaded.

Why: when a node cannot reach the rendezvous, c10d's TCPStore client in the launcher logs every retry
with a C++ stack trace (dozens of lines) before the launcher prints its one line with a HINT. torch reads
``TORCH_CPP_LOG_LEVEL`` once, at import, into c10's ``FLAGS_caffe2_log_level``; the launcher cannot set
the variable for its import any more, because the workers' fork server is forked from the launcher after
that import (:mod:`.forkserver`: one import of torch per launch, not two) and the workers must start with
the level a new interpreter has. So torch loads with the user's level, the server is forked, and then the
launcher alone turns the flag to FATAL. c10 reads the flag at every log call.

Where the flag cannot be found (a torch build without ``libc10.so``), nothing changes: the launcher then
logs at the user's level, as ``--verbose`` does.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Optional

#: c10's levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL.
FATAL = 3


def _level_flag() -> Optional[ctypes.c_int]:
    """c10's log level of this process (torch loaded), or None where it cannot be found."""
    torch = sys.modules.get("torch")
    if torch is None or torch.__file__ is None or not sys.platform.startswith("linux"):
        return None
    try:  # RTLD_NOLOAD: the copy torch loaded, never a second one
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"),
                              mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


def quiet_cpp_logs(verbose: bool) -> Optional[int]:
    """Load torch, then lower this process's C++ log level to FATAL, unless ``verbose`` or the user chose a
    level (``TORCH_CPP_LOG_LEVEL``). Returns the level it had (None: unchanged)."""
    import torch  # noqa: F401

    if verbose or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return None
    flag = _level_flag()
    if flag is None:
        return None
    before, flag.value = flag.value, FATAL
    return before


def set_cpp_log_level(level: Optional[int]) -> None:
    """Put back what :func:`quiet_cpp_logs` returned (None: nothing to do)."""
    if level is None:
        return
    flag = _level_flag()
    if flag is not None:
        flag.value = level
