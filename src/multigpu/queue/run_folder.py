"""What a queued run's folder holds and says: its status, its resolved settings, its log - and what to
do with the run next (start, resume, skip or start fresh).

Why a module of its own: the local queue, ``--slurm`` and the searches all read a run's folder by the
same rules - a restarted queue skips what finished with the same settings and resumes the rest - and
none of that needs the scheduler that starts processes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from multigpu.errors import ConfigError, last_shown, visible
from multigpu.fileio import Folder, atomic_write_text, ensure_real_folder
from multigpu.queue.runs import QueueEntry

STATUS_FILE = "status.json"


LOG_FILE = "log.txt"


CONFIG_FILE = "run.yaml"


@dataclass(frozen=True)
class Decision:
    # "start" (new), "resume", "skip" (finished with these settings) or "fresh" (settings changed)
    action: str
    note: str
    status: dict[str, Any]


def decide(
    folder: Path, fingerprint: str, active_job: Optional[Callable[[str], bool]] = None
) -> Decision:
    """What to do with a run given what its folder says - the same rules for the local queue and for
    ``--slurm`` (``active_job``: is this Slurm job still queued or running?)."""
    status = read_status(folder)
    if not status:
        return Decision("start", "", status)
    job = str(status.get("job_id") or "")
    if active_job is not None and job and active_job(job):
        if status.get("fingerprint") != fingerprint:
            raise ConfigError(
                f"the settings of run {folder.name!r} changed but its Slurm job {job} is still queued or "
                "running.",
                f"wait for it, or cancel it first (`multigpu slurm cancel {job}`).",
            )
        return Decision("skip", f"already submitted as job {job}", status)
    if status.get("fingerprint") != fingerprint:
        return Decision("fresh", "settings changed", status)
    if status.get("state") == "done":
        return Decision("skip", "finished earlier", status)
    return Decision("resume", f"{status.get('state', 'stopped')} earlier: resuming", status)


def write_run_config(folder: Path, spec: QueueEntry) -> None:
    """The run's folder (never a symbolic link: it would be written through) with its resolved settings."""
    ensure_real_folder(folder, "run folder")
    atomic_write_text(folder / CONFIG_FILE, yaml.safe_dump(spec.resolved(), sort_keys=False))
    spec.prepare(folder)


def finished_as(folder: Path, fingerprint: Optional[str]) -> bool:
    """Whether the run folder ``folder`` (a real folder, not a link) says done, with these settings."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    status = read_status(folder)
    return (
        status.get("state") == "done"
        and fingerprint is not None
        and status.get("fingerprint") == fingerprint
    )


def read_status(folder: Path) -> dict[str, Any]:
    """The run's status.json, checked field by field ({} if missing, unreadable or malformed)."""
    try:
        status = json.loads(Folder(folder).load_text(STATUS_FILE, limit=1 << 20))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(status, dict):
        return {}
    checked: dict[str, object] = {}
    for key, kind in _STATUS_FIELDS.items():
        value = status.get(key)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            # JSON's integers have no bound
            value = float(value) if abs(value) < 1 << 1000 else None
        if isinstance(value, float) and not math.isfinite(value):
            continue
        if isinstance(value, kind) and not isinstance(value, bool):
            # printed in the table
            checked[key] = visible(value[:200]) if isinstance(value, str) else value
    return checked


def move_aside(folder: Path) -> str:
    """Keep the outputs of earlier settings under ``<name>.old-<time>`` (never overwrite, never delete)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parent = Folder(folder.parent)
    aside, n = f"{folder.name}.old-{stamp}", 1
    while parent.kind(aside) is not None:
        aside, n = f"{folder.name}.old-{stamp}-{n}", n + 1
    parent.move(folder.name, aside)
    return f"settings changed: earlier outputs moved to {aside}"


def log_tail(folder: Path, lines: int = 15) -> list[str]:
    raw, _ = Folder(folder).tail_lines(LOG_FILE, lines * 20, 256 * 1024)
    return last_shown(raw, lines)


#: The fields of status.json and their types: a status file is data from disk (a received or copied
#: queue folder) - anything else in it is dropped, a field of the wrong type is as if it were missing.
_STATUS_FIELDS = {
    "state": str,
    "exit_code": int,
    "started": float,
    "ended": float,
    "slots": list,
    "share": str,
    "fingerprint": str,
    "job_id": str,
}
