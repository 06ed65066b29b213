"""What the launcher says about how its workers ended: the one line of a failure (the rank that started
it, its recorded error or the tail of its stderr), a restart's line, a clean preemption.

Why its own module: torch's agent reports the rank with the earliest error file (whole seconds, often one
that merely lost its peer) in a traceback; what a user needs is one line naming the culprit, and the
launcher's start and stop (local.py) should not have to be read to change it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from typing_extensions import override

from multigpu.errors import last_shown, visible
from multigpu.fileio import Folder, tail_lines
from multigpu.launch.attempts import files_of, lost_a_peer, recorded

STDERR_TAIL_LINES = 20
#: What a restart's line says happens next (a queue's or replica group's launch says its own).
RESTART_NOTE = "they resume from the last checkpoint"


class RestartReporter(logging.Handler):
    """One line when torch's agent restarts the workers: which rank ended the attempt, why, and which
    restart of how many this is (torch logs it at INFO, which we keep quiet, with no rank in it)."""

    MESSAGE = "will restart worker group"

    def __init__(self, log_dir: str, first_rank: int, note: str = RESTART_NOTE) -> None:
        super().__init__(logging.INFO)
        self.log_dir, self.first_rank, self.restarts, self.note = log_dir, first_rank, 0, note

    @override
    def emit(self, record: logging.LogRecord) -> None:
        if self.MESSAGE not in str(record.msg) or "attempts left" not in str(record.msg):
            return  # a membership change (a node joined) is not a failure
        from multigpu.launch.attempts import culprits, outcomes

        left, most = (
            (record.args[2], record.args[3])
            if isinstance(record.args, tuple) and len(record.args) >= 4
            else (None, None)
        )
        found = culprits(outcomes(self.log_dir, self.restarts, self.first_rank))
        why = "; ".join(w.describe() for w in found[:3]) or "a worker failed on another node"
        counted = (
            f"restart {most - left + 1} of {most}"
            if isinstance(left, int) and isinstance(most, int)
            else "a restart"
        )
        self.restarts += 1
        say(f"{why}. Restarting every worker ({counted}): {self.note}.")


@contextlib.contextmanager
def reporting_restarts(
    log_dir: str, first_rank: int, verbose: bool, note: str = RESTART_NOTE
) -> Iterator[None]:
    """Attach a :class:`RestartReporter` to torch's agent logger for the launch (quiet otherwise)."""
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    saved = (agent_log.level, agent_log.propagate)
    reporter = RestartReporter(log_dir, first_rank, note)
    if not verbose:  # only our line: torch's own INFO records stay quiet
        agent_log.propagate = False
    agent_log.setLevel(logging.INFO)
    agent_log.addHandler(reporter)
    try:
        yield
    finally:
        agent_log.removeHandler(reporter)
        agent_log.setLevel(saved[0])
        agent_log.propagate = saved[1]


def preempted_cleanly(log_dir: str) -> bool:
    """Every worker of the newest attempt left with EXIT_PREEMPTED (its checkpoint written)."""
    from multigpu.launch.attempts import all_preempted, outcomes

    attempts = [attempt for _, attempt, _ in files_of(log_dir, "pid")]
    return bool(attempts) and all_preempted(outcomes(log_dir, max(attempts)))


def has_logs(log_dir: str) -> bool:
    return any(Path(log_dir).glob("rank*.stderr"))


def _exit_status(exitcode: int) -> int:
    return 128 - exitcode if exitcode < 0 else (exitcode or 1)


_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP), int(signal.SIGUSR1)}


def _status(rank: int, failure: Any, log_dir: str) -> int:
    """A rank stopped by the launcher during its teardown keeps the status it recorded (worker.py) before."""
    status = recorded(log_dir, rank) if -failure.exitcode in _STOP_SIGNALS else None
    return status if status is not None and 0 < status < 256 else _exit_status(failure.exitcode)


def root_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure that started it. torch orders by error-file timestamps (whole seconds), which often
    picks a rank that merely noticed that another one had died. Ours, most telling first: a rank killed
    by a signal nobody sends on purpose at shutdown (SIGKILL, SIGSEGV, SIGABRT...); a rank whose own
    error is not a lost peer; a rank stopped by SIGTERM/SIGINT (the launcher stops the survivors that
    way); a rank that lost its peer. Ties go to the earliest, then the lowest rank."""

    def key(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, failure = item
        message = str(getattr(failure, "message", "")).lower()
        if failure.exitcode < 0:
            priority = 2 if -failure.exitcode in _STOP_SIGNALS else 0
        else:
            priority = 3 if lost_a_peer(message) else 1
        return (priority, failure.timestamp, rank)

    return min(failures.items(), key=key)


def one_line_error(failure: Any) -> str:
    """The ``multigpu: error: ...`` line a worker recorded for a MultiGPUError ('' for other failures)."""
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        return str((message.get("extraInfo") or {}).get("multigpu_error") or "")
    return ""


def recorded_errors(log_dir: str) -> list[str]:
    """The distinct ``multigpu: error:`` lines workers recorded in torch's error files, with their ranks."""
    lines: dict[str, list[str]] = {}
    root = Folder(log_dir)
    for path in sorted(Path(log_dir).glob("*/attempt_*/*/error.json")):
        try:
            message = json.loads(root.load_text(path.relative_to(log_dir), limit=1_000_000)).get(
                "message"
            )
        except (OSError, ValueError, AttributeError, RecursionError):
            continue
        line = (
            (message.get("extraInfo") or {}).get("multigpu_error")
            if isinstance(message, dict)
            else None
        )
        if line:
            lines.setdefault(line, []).append(path.parent.name)
    return [
        f"{line} (local rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)})"
        for line, ranks in lines.items()
    ]


def report_failure(failures: dict[int, Any], log_dir: str) -> int:
    """Print the failure once: a MultiGPUError every failed rank shares as one line ("on all N ranks"),
    otherwise the root-cause rank with the tail of its stderr. Ranks the launcher stopped itself
    (SIGTERM after the first failure) are not counted as failures."""
    rank, failure = root_cause(failures)
    own = {r: f for r, f in failures.items() if not (r != rank and -f.exitcode in _STOP_SIGNALS)}
    lines = {r: one_line_error(f) for r, f in own.items()}
    how = (
        f"was killed by {failure.signal_name()}"
        if failure.exitcode < 0
        else f"exited with code {failure.exitcode}"
    )
    if lines.get(rank):
        same = [r for r, line in lines.items() if line == lines[rank]]
        stopped = len(failures) - len(own)
        if len(same) == len(failures) and len(same) > 1:
            where = f" (on all {len(same)} ranks)"
        elif len(failures) > 1:
            where = (
                f" (on rank{'s' if len(same) > 1 else ''} {', '.join(map(str, sorted(same)))}"
                + (f"; {stopped} other rank(s) stopped by the launcher" if stopped else "")
                + ")"
            )
        else:
            where = ""
        print(f"{visible(lines[rank])}{where}", file=sys.stderr, flush=True)
        others = len(own) - len(same)
        if others:
            say(
                f"{others} other rank(s) failed differently; logs of every rank are kept in {log_dir}"
            )
        return _status(rank, failure, log_dir)
    others = len(own) - 1
    also = f"; {others} other rank(s) failed after it" if others else ""
    # the worker's own (a forked one is not the agent's child)
    pid = recorded(log_dir, rank, "pid") or failure.pid
    say(f"error: rank {rank} (local rank {failure.local_rank}, pid {pid}) {how}{also}.")
    stderr_log = _stderr_log(log_dir, rank)
    tail = _tail(stderr_log, STDERR_TAIL_LINES) if stderr_log else []
    if tail:
        say(f"last lines of rank {rank}'s stderr ({stderr_log}):")
        for line in tail:
            print(f"    {line}", file=sys.stderr)
    say(f"logs of every rank are kept in {log_dir}")
    return _status(rank, failure, log_dir)


def _stderr_log(log_dir: str, rank: int) -> Optional[Path]:
    """The newest attempt's copy of rank ``rank``'s stderr (see worker.stream_log_path)."""
    logs = files_of(log_dir, "stderr", rank)
    return logs[-1][2] if logs else None


def _tail(path: Path, lines: int) -> list[str]:
    """The last lines as a terminal would have shown them (see :func:`multigpu.errors.as_shown`)."""
    raw, _ = tail_lines(path, lines * 20, 64 * 1024)
    return last_shown(raw, lines)


def say(message: str) -> None:
    """One line of the launcher's, terminal-safe (a path or a name in it may come from outside)."""
    print(f"multigpu: {visible(message)}", file=sys.stderr, flush=True)
