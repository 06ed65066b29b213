"""The launchers a launch of launches starts - simulated nodes, replica groups - supervised in one place.

Why: each kept a loop of its own to start its children, forward a stop signal, give them a deadline,
reap them and say how they ended, and the loops differed where they should not (a second Ctrl-C ended
replica groups at once, simulated nodes only after 30 s). Here: each child in a session of its own (a
terminal's Ctrl-C reaches only this process, which forwards it once); the first stop signal goes on to
every child that still runs and starts the deadline; a second one, or the deadline, ends them with SIGKILL;
whatever happens, nothing is left running when the block ends.
"""

from __future__ import annotations

import signal
import subprocess
import time
from types import TracebackType
from typing import Any, Callable, Mapping, Optional, Sequence

#: ``ended(index, status)`` for each child as it ends; True stops the others (SIGTERM, then SIGKILL at
#: the deadline).
Ended = Callable[[int, int], bool]


class Children:
    """``with Children(signals, grace_s) as children: children.start(...); codes = children.watch(ended)``."""

    def __init__(self, signals: Sequence[int], grace_s: float, poll_s: float = 0.1) -> None:
        self.signals, self.grace_s, self.poll_s = tuple(signals), grace_s, poll_s
        self.procs: list[subprocess.Popen[Any]] = []
        #: The stop signals this process received, in order.
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "Children":
        for sig in self.signals:
            self._previous[sig] = signal.signal(
                sig, lambda signum, frame: self.received.append(signum)
            )
        return self

    def __exit__(
        self,
        kind: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def start(self, command: Sequence[str], env: Optional[Mapping[str, str]] = None) -> None:
        # env None: this one's
        self.procs.append(
            subprocess.Popen(
                list(command), start_new_session=True, env=None if env is None else dict(env)
            )
        )

    def running(self) -> int:
        return sum(proc.poll() is None for proc in self.procs)

    def signal_all(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def watch(self, ended: Ended) -> dict[int, int]:
        """Until every child has ended: each one's status, by its index."""
        codes: dict[int, int] = {}
        forwarded = 0
        deadline: Optional[float] = None
        while len(codes) < len(self.procs):
            if len(self.received) > forwarded:
                if forwarded == 0:
                    self.signal_all(self.received[0])
                # a second stop, even one that came with the first: at once
                if len(self.received) > 1:
                    self.signal_all(signal.SIGKILL)
                forwarded = len(self.received)
                deadline = deadline or time.monotonic() + self.grace_s
            for index, proc in enumerate(self.procs):
                code = proc.poll()
                if code is not None and index not in codes:
                    codes[index] = code
                    if ended(index, code) and deadline is None:
                        self.signal_all(signal.SIGTERM)
                        deadline = time.monotonic() + self.grace_s
            if deadline is not None and time.monotonic() > deadline:
                self.signal_all(signal.SIGKILL)
            if len(codes) < len(self.procs):
                time.sleep(self.poll_s)
        return codes
