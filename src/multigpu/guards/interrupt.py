"""Ctrl-C marks every live Run of this process as interrupted, then raises KeyboardInterrupt as usual.

Why: after Ctrl-C the other ranks may be anywhere; a collective this rank starts afterwards (a
checkpoint, a barrier at exit) would wait for partners that are not coming. Marked guards refuse it at
once with one line, so every rank is out within seconds.

Signal handlers belong to the process, not to a Run: the set of guards to mark and the handler that
was there before are the one piece of process-wide state, kept here and nowhere else. Only Python's
own default handler is replaced, only on the main thread, only for multi-process jobs.
"""

from __future__ import annotations

import signal
import threading
import weakref
from typing import Any

from multigpu.guards import Guards

_TO_MARK: "weakref.WeakSet[Guards]" = weakref.WeakSet()
_PREVIOUS_HANDLER: list[Any] = []


def _on_interrupt(signum: int, frame: Any) -> None:
    for guards in list(_TO_MARK):
        guards.interrupt("Ctrl-C")
    raise KeyboardInterrupt


def install(guards: Guards, distributed: bool) -> None:
    """Mark ``guards`` on SIGINT (multi-process jobs, main thread, Python's default handler only)."""
    if not distributed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _PREVIOUS_HANDLER.append(signal.signal(signal.SIGINT, _on_interrupt))
    if signal.getsignal(signal.SIGINT) is _on_interrupt:
        _TO_MARK.add(guards)


def remove(guards: Guards) -> None:
    """Stop marking ``guards``; the previous handler is back once no Run is left."""
    _TO_MARK.discard(guards)
    if (
        not _TO_MARK
        and _PREVIOUS_HANDLER
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is _on_interrupt
    ):
        signal.signal(signal.SIGINT, _PREVIOUS_HANDLER.pop())
