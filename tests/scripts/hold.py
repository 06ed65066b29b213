"""Hold every rank at a step a test chose until a stop signal arrives, for tests that signal a run mid-training.

Why: a test that sleeps in every step and signals "soon" races the run - on a busy machine the run may
end before the signal, or the signal land at any step. Here each rank, at the chosen step, writes
OUT/held-rank<r> (its pid) and waits until a stop signal (SIGTERM, SIGUSR1) reached it or reached
another rank (which writes OUT/signal-arrived). The test waits for every held-rank file, then signals:
the signal lands at a known step, however slow the machine. The library's own handlers still receive
the signal (they are wrapped, not replaced), and the hang watchdog is paused while a rank waits.

    from hold import hold, released
    if step == args.hold_at and not released(out):
        hold(out, run)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def released(out: Path) -> bool:
    """A stop signal already arrived (in this run or the one it resumes): no more holding."""
    return (Path(out) / "signal-arrived").exists()


def hold(out: Path, run: Any) -> None:
    """Wait until a stop signal reached this rank or another one; ``run`` is the ``mg.init()`` Run."""
    out = Path(out)
    arrived, got = out / "signal-arrived", []
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def on_signal(signum: int, frame: Any) -> None:
        got.append(signum)
        arrived.write_text(str(run.rank))
        if callable(previous[signum]):
            previous[signum](signum, frame)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    with run.paused_watchdog():
        (out / f"held-rank{run.rank}").write_text(str(os.getpid()))
        while not got and not arrived.exists():
            time.sleep(0.01)
