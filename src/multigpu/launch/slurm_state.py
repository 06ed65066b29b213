"""What became of Slurm jobs: ``multigpu slurm status`` / ``logs`` and the queue's status table.

Why sacct first: ``scontrol`` answers from the controller's memory, which forgets a job ``MinJobAge``
seconds (default 300) after it ends - a failed job vanishes before anyone looks. ``sacct`` reads the
accounting database, which keeps finished, failed and requeued jobs (each requeue is one more row with
``--duplicates``, which is how the restarts are counted). Clusters without job accounting have no
``sacct`` answer (it exits non-zero: accounting disabled, slurmdbd down); then ``scontrol`` is
asked, and the output says so.

Why ``--parsable2`` and not ``--json``: on Slurm 22.05 (Debian 12) ``sacct --json`` reports
``exit_code`` ``SUCCESS``/0 for a job that exited 3 (``--parsable2`` says ``3:0``) and has no submit
line, and its layout changes with every data_parser version; the ``-o`` fields of ``--parsable2`` have
kept their names and meaning across versions.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from multigpu import validate
from multigpu.errors import LaunchError
from multigpu.fileio import Folder, tail_lines
from multigpu.launch.slurm import (
    ACTIVE_STATES,
    SCRIPT_NAME,
    TASKS_FILE,
    call,
    check_job_id,
    job_infos,
    slurm_tool,
)

#: sacct fields read (SubmitLine last: it is the one that may hold a ``|``).
SACCT_FIELDS = (
    "JobID",
    "JobIDRaw",
    "JobName",
    "State",
    "Reason",
    "ExitCode",
    "Elapsed",
    "NodeList",
    "Submit",
    "SubmitLine",
)


@dataclass(frozen=True)
class JobRecord:
    job_id: str  # 123, 123_4 (array task), 123_[5-9%2] (tasks not started yet)
    name: str
    state: str  # COMPLETED, FAILED, PENDING, RUNNING, CANCELLED, ...
    reason: str  # why it is pending
    exit_code: str  # "3:0": exit status : signal
    elapsed: str
    nodes: str
    submitted: str
    restarts: int
    script: str  # the job's script, "" when unknown
    log: str  # its log, "" when unknown
    source: str  # "sacct" or "scontrol"

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def line(self) -> str:
        """``job 12 (trai-k3f): FAILED, exit 3:0, elapsed 00:00:04, restarts 0, nodes n1, log ... [sacct]``"""
        if self.state == "PENDING":
            what = f"PENDING ({self.reason or '?'}), submitted {self.submitted or '?'}"
        elif self.active:
            what = f"{self.state}, elapsed {self.elapsed or '?'}, restarts {self.restarts}, nodes {self.nodes or '?'}"
        else:
            what = (
                f"{self.state}, exit {self.exit_code or '?'}, elapsed {self.elapsed or '?'}, restarts {self.restarts}, "
                f"nodes {self.nodes or '?'}"
            )
        return f"job {self.job_id} ({self.name}): {what}, log {self.log or '?'} [{self.source}]"


def current_user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def parse_sacct(text: str) -> list[JobRecord]:
    """``sacct -X -D --parsable2 --noheader -o SACCT_FIELDS`` rows, one record per job: its latest row,
    with one restart for every earlier row of the same job (each requeue leaves one)."""
    rows: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        values = line.split("|", len(SACCT_FIELDS) - 1)
        if len(values) != len(SACCT_FIELDS):
            continue  # not a row of ours (a warning line)
        row = dict(zip(SACCT_FIELDS, values))
        rows.setdefault(row["JobID"], []).append(row)
    records = []
    for job_id, instances in rows.items():
        last = instances[-1]
        script = _script_of_submit_line(last["SubmitLine"])
        records.append(
            JobRecord(
                job_id=job_id,
                name=last["JobName"],
                state=last["State"].split(" ")[0],
                reason=last["Reason"],
                exit_code=last["ExitCode"],
                elapsed=last["Elapsed"],
                nodes=last["NodeList"],
                submitted=last["Submit"],
                restarts=len(instances) - 1,
                script=script,
                log=_log_of(job_id, last["JobIDRaw"], script, ""),
                source="sacct",
            )
        )
    return records


def _script_of_submit_line(line: str) -> str:
    try:
        words = shlex.split(line)
    except ValueError:
        return ""
    return words[-1] if words and words[0].endswith("sbatch") else ""


def _log_of(job_id: str, raw_id: str, script: str, stdout: str) -> str:
    """Our jobs log into their run folder: ``slurm-<id>.out`` next to the script; an array task into its
    run's folder, found in the array's task map. Other jobs: what scontrol says (or nothing)."""
    if Path(script).name != SCRIPT_NAME:
        return stdout
    folder = Path(script).parent
    match = re.fullmatch(r"([0-9]+)_([0-9]+)", job_id)
    if match is None:
        return str(folder / f"slurm-{raw_id or job_id}.out")
    try:
        tasks = json.loads(Folder(folder).load_text(TASKS_FILE, limit=16 << 20))
        return str(Path(tasks[match.group(2)]) / f"slurm-{job_id}.out")
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return stdout


def _record_of_scontrol(info: dict[str, str]) -> JobRecord:
    array, task = info.get("ArrayJobId"), info.get("ArrayTaskId")
    job_id = info.get("JobId", "?")
    if array and task:
        job_id = f"{array}_{task}" if validate.is_digits(task) else f"{array}_[{task}]"
    script = info.get("Command", "")
    return JobRecord(
        job_id=job_id,
        name=info.get("JobName", "?"),
        state=info.get("JobState", "?"),
        reason=info.get("Reason", ""),
        exit_code=info.get("ExitCode", ""),
        elapsed=info.get("RunTime", ""),
        nodes=info.get("NodeList", ""),
        submitted=info.get("SubmitTime", ""),
        restarts=int(info.get("Restarts", "0") or 0)
        if validate.is_digits(info.get("Restarts", "0"))
        else 0,
        script=script,
        log=_log_of(job_id, info.get("JobId", ""), script, info.get("StdOut", "")),
        source="scontrol",
    )


def sacct(
    job_ids: Sequence[str] = (), user: Optional[str] = None, days: int = 7
) -> Optional[list[JobRecord]]:
    """Records from the accounting database, or None when this cluster has none (or sacct is missing)."""
    tool = shutil.which("sacct")
    if tool is None:
        return None
    args = [tool, "-X", "-D", "--parsable2", "--noheader", "-o", ",".join(SACCT_FIELDS)]
    # -E in the future: a job that may only start later (--begin) is eligible after "now", sacct's default end
    window = ["-E", "now+366days"]
    if job_ids:
        args += ["-j", ",".join(check_job_id(j) for j in job_ids), "-S", "1970-01-01", *window]
    else:
        args += ["-u", user or current_user(), "-S", f"now-{days}days", *window]
    done = call(args)
    # no accounting ("accounting storage is disabled"), slurmdbd down, no config:
    if done.returncode != 0:
        # scontrol answers for the jobs the controller still holds, or says why it cannot
        return None
    found = parse_sacct(done.stdout)
    arrays = sorted({r.job_id.split("_")[0] for r in found if "_" in r.job_id})
    if job_ids or not arrays:
        return found
    # Slurm 22.05 leaves the eligible time of an array's first split task unset, so a time window misses it;
    # asked for by id, every task is there.
    tasks = sacct(arrays) or []
    return [r for r in found if r.job_id.split("_")[0] not in arrays] + tasks


def _live(found: list[JobRecord]) -> list[JobRecord]:
    """A job still queued or running: the controller's own record (its pending reason is current; a job
    submitted a moment ago has no name or submit line in accounting yet), with the restarts counted."""
    out = []
    for record in found:
        if record.active and re.fullmatch(r"[0-9]+(_[0-9]+)?", record.job_id):
            infos = job_infos(record.job_id)
            if len(infos) == 1:
                live = _record_of_scontrol(infos[0])
                record = replace(live, restarts=max(live.restarts, record.restarts))
        out.append(record)
    return out


def records(job_ids: Sequence[str]) -> dict[str, list[JobRecord]]:
    """Each job's records (an array job id: one per task), from sacct, else scontrol; [] when unknown."""
    found = _live(sacct(job_ids) or []) if job_ids else []
    out: dict[str, list[JobRecord]] = {}
    for job_id in job_ids:
        mine = [r for r in found or [] if r.job_id == job_id or r.job_id.startswith(f"{job_id}_")]
        if not mine:  # no accounting, or not recorded yet (just submitted)
            mine = [_record_of_scontrol(info) for info in job_infos(job_id)]
        out[job_id] = mine
    return out


def job_records(job_id: str) -> list[JobRecord]:
    found = records([check_job_id(job_id)])[job_id]
    if not found:
        raise LaunchError(
            f"Slurm knows no job {job_id}.",
            "check the id with `multigpu slurm status` (your jobs of "
            "the last days) or `squeue --me`; without job accounting finished jobs are forgotten after "
            "MinJobAge.",
        )
    return found


def my_jobs(days: int = 7) -> tuple[list[JobRecord], str]:
    """This user's jobs written by multigpu (their script is a job.sbatch), newest last, and the source."""
    user = current_user()
    found = sacct(user=user, days=days)
    source = f"sacct, submitted in the last {days} day(s)"
    if found is None:
        uid = f"{user}("
        found = [_record_of_scontrol(i) for i in job_infos() if i.get("UserId", "").startswith(uid)]
        source = "scontrol: this cluster keeps no job accounting, so jobs that ended more than MinJobAge ago are gone"
    else:
        found = _live(found) + _not_in_accounting_yet(user, {r.job_id.split("_")[0] for r in found})
    mine = [r for r in found if Path(r.script).name == SCRIPT_NAME]
    return sorted(
        mine,
        key=lambda r: [
            int(n) if validate.is_digits(n) else -1 for n in re.split(r"[_+]", r.job_id)
        ],
    ), source


def _not_in_accounting_yet(user: str, known: set[str]) -> list[JobRecord]:
    """Queued jobs that accounting has no row for yet (one held until a later --begin, for one)."""
    done = call([slurm_tool("squeue"), "-u", user, "-h", "-o", "%i"])
    # an array task 12_3 and a heterogeneous job's component 77+0 are parts of the jobs 12 and 77
    ids = (
        {re.split(r"[_+]", line.strip())[0] for line in done.stdout.split() if line.strip()}
        if done.returncode == 0
        else set()
    )
    return [
        _record_of_scontrol(info)
        for job_id in sorted((i for i in ids - known if validate.is_digits(i)), key=int)
        for info in job_infos(job_id)
    ]


def table(rows: Sequence[JobRecord]) -> str:
    """Columns for a terminal: id, name, state (with why it is pending), exit, elapsed, restarts, log."""
    header = ("JOBID", "NAME", "STATE", "EXIT", "ELAPSED", "RESTARTS", "LOG")
    lines = [header] + [
        (
            r.job_id,
            r.name,
            r.state + (f" ({r.reason})" if r.state == "PENDING" else ""),
            "" if r.active else r.exit_code,
            r.elapsed,
            str(r.restarts),
            r.log,
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(line, widths)), line[-1]]).rstrip()
        for line in lines
    )


def log_tail(job_id: str, lines: int = 50) -> tuple[Path, list[str], int]:
    """(log path, its last ``lines`` lines, the number of lines) - read from the end, whatever its size."""
    found = job_records(job_id)
    if len(found) > 1:
        raise LaunchError(
            f"job {job_id} is an array of {len(found)} tasks.",
            f"name one task, e.g. `multigpu slurm logs {found[0].job_id}`.",
        )
    record = found[0]
    if not record.log:
        raise LaunchError(
            f"Slurm does not say where job {job_id} logs.",
            "look in its run folder (slurm-<id>.out).",
        )
    path = Path(record.log)
    if not path.is_file():
        raise LaunchError(
            f"job {job_id} has no log yet at {path}.",
            "it may still be pending: `multigpu slurm status`.",
        )
    tail, total = tail_lines(path, lines)
    return path, tail, total
