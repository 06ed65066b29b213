"""Process plumbing shared by the launcher's workers and the queue's runs: die with the parent.

Why: a worker whose launcher was SIGKILLed, or a run whose queue died, must not live on as an orphan
holding GPUs. Linux delivers a chosen signal to a child when its parent dies (``PR_SET_PDEATHSIG``);
elsewhere this is a no-op and the parents' own cleanup is all there is.
"""

from __future__ import annotations

import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; True if it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
