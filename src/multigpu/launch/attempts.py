"""What each worker of an attempt did, as the launcher reads it back: its pid, its exit status, its error.

Why files: torch's elastic agent decides to restart (or to stop) inside its own loop and tells nobody
which rank failed or why until the very end. Each worker therefore leaves two small files in the log
folder - ``rankR.attemptK.pid`` when it starts and ``rankR.attemptK.exit`` when it leaves - and torch's
error file when a Python exception ended it. From them the launcher can say, at the moment of a
restart, "rank 1 was killed by a signal" rather than nothing, and at a preemption whether every
worker stopped cleanly with its checkpoint (status 75) so the launcher reports 75 too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from multigpu import validate
from multigpu.errors import EXIT_PREEMPTED, visible
from multigpu.fileio import Folder

#: The names workers leave in the log folder; anything else there (a stray "rank0.attempt0 (copy).stderr")
#: is not ours and is ignored.
_NAME = re.compile(r"^rank([0-9]{1,7})\.attempt([0-9]{1,7})\.(stderr|pid|exit|stacks)$")


def parse_name(name: str) -> Optional[tuple[int, int, str]]:
    """(rank, attempt, kind) of a file workers leave in the log folder, or None for anything else."""
    found = _NAME.match(name)
    return (int(found.group(1)), int(found.group(2)), found.group(3)) if found else None


def files_of(log_dir: str, kind: str, rank: Optional[int] = None) -> list[tuple[int, int, Path]]:
    """(rank, attempt, path) of every ``kind`` file (of ``rank``), ordered by attempt then rank."""
    found = []
    for path in Path(log_dir).glob(f"rank*.attempt*.{kind}"):
        parsed = parse_name(path.name)
        if parsed and parsed[2] == kind and (rank is None or parsed[0] == rank):
            found.append((parsed[0], parsed[1], path))
    return sorted(found, key=lambda item: (item[1], item[0]))


def record_path(log_dir: str, rank: int, attempt: int, kind: str) -> Path:
    """``kind``: "pid", "exit" or "stacks" (exit_watch.py)."""
    return Path(log_dir) / f"rank{rank}.attempt{attempt}.{kind}"


def clear_records(log_dir: str) -> None:
    """Remove an earlier launch's records (pid, exit, stacks) from a reused ``--log-dir``: the launcher and
    its exit watch read this launch's only. Its stderr logs stay until this launch's ranks rewrite them."""
    root = Folder(log_dir)
    for kind in ("pid", "exit", "stacks"):
        for _, _, path in files_of(log_dir, kind):
            try:
                root.remove(path.name)
            except OSError:
                pass


def write_record(log_dir: Optional[str], rank: int, attempt: int, kind: str, value: int) -> None:
    if not log_dir:
        return
    try:
        Folder(log_dir).write_atomic(record_path(log_dir, rank, attempt, kind).name, str(value))
    except OSError:
        pass  # a record is for the report; the run goes on without it


@dataclass(frozen=True)
class WorkerOutcome:
    rank: int
    #: The status the worker left with (None: no exit record - killed by a signal, or still running).
    status: Optional[int]
    alive: bool
    #: The first line of the error it recorded ('' if none).
    error: str

    def describe(self) -> str:
        if self.error:
            return f"rank {self.rank} failed: {self.error}"
        if self.status is not None:
            return f"rank {self.rank} exited with status {self.status}"
        return (
            f"rank {self.rank} ended without a word (killed by a signal: SIGKILL, a crash, or the "
            "out-of-memory killer)"
        )


def read_int(path: Path) -> Optional[int]:
    try:
        text = Folder(path.parent).load_text(path.name, limit=20).strip()
    except OSError:
        return None
    return int(text) if validate.is_digits(text.lstrip("-")) else None


def recorded(log_dir: str, rank: int, kind: str = "exit") -> Optional[int]:
    """What rank ``rank`` recorded in the newest attempt (of any rank): its exit status before it left, or
    its pid (None: none recorded - a worker that died before writing its pid file has none, and never an
    earlier attempt's)."""
    attempts = [attempt for _, attempt, _ in files_of(log_dir, "pid")]
    return read_int(record_path(log_dir, rank, max(attempts), kind)) if attempts else None


def _alive(pid: Optional[int]) -> bool:
    if pid is None:
        return False
    try:
        state = Folder(f"/proc/{pid}").load_text("stat", limit=4096).rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _errors(log_dir: str, attempt: int) -> dict[int, str]:
    """local rank -> the first line of the error torch's error file holds for ``attempt``."""
    found: dict[int, str] = {}
    root = Folder(log_dir)
    for path in Path(log_dir).glob(f"*/attempt_{attempt}/*/error.json"):
        try:
            message = json.loads(root.load_text(path.relative_to(log_dir), limit=1_000_000)).get(
                "message"
            )
        except (OSError, ValueError, AttributeError, RecursionError):
            continue
        if isinstance(message, dict):
            line = (
                (message.get("extraInfo") or {}).get("multigpu_error")
                or message.get("message")
                or ""
            )
        else:
            line = str(message or "")
        if validate.is_digits(path.parent.name) and line:
            found[int(path.parent.name)] = visible(" ".join(str(line).split())[:300])
    return found


def outcomes(log_dir: str, attempt: int, first_rank: int = 0) -> list[WorkerOutcome]:
    """Every worker of this node in ``attempt`` (ranks from ``first_rank``), in rank order."""
    ranks = sorted(
        rank for rank, found_attempt, _ in files_of(log_dir, "pid") if found_attempt == attempt
    )
    errors = _errors(log_dir, attempt)
    return [
        WorkerOutcome(
            rank,
            read_int(record_path(log_dir, rank, attempt, "exit")),
            _alive(read_int(record_path(log_dir, rank, attempt, "pid"))),
            errors.get(rank - first_rank, ""),
        )
        for rank in ranks
    ]


#: Messages of ranks that failed only because a peer went away first.
PEER_GONE = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "dist backend error",
    "distbackenderror",
    "nccl communicator was aborted",
    "socket timeout",
    "connection refused",
    "ranks disagree before training",
)


def lost_a_peer(message: str) -> bool:
    """True for the error of a rank that failed only because another one went away."""
    lowered = message.lower()
    return any(p in lowered for p in PEER_GONE)


def culprits(found: list[WorkerOutcome]) -> list[WorkerOutcome]:
    """The workers that ended the attempt, most telling first: gone without a record (a signal), then
    with their own error or status. Ranks that only lost a peer are left out when another rank is to
    blame; ranks still running are the innocent ones the agent is about to stop."""
    gone = [w for w in found if not w.alive and (w.error or w.status is None or w.status != 0)]
    own = [w for w in gone if not lost_a_peer(w.error)]
    return sorted(own or gone, key=lambda w: (w.status is not None, w.rank))


def all_preempted(found: list[WorkerOutcome], status: int = EXIT_PREEMPTED) -> bool:
    """Every worker left with the preemption status after its checkpoint."""
    return bool(found) and all(w.status == status for w in found)
