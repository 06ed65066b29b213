"""``multigpu slurm``: write a readable sbatch script into the run folder, submit it, follow the job.

The script is the sbatch + srun recipe of SpeechBrain's multi-GPU guide in one: one task per node, each running
``multigpu run`` with a c10d rendezvous on the first node. The master address comes from the node
list through ``scontrol show node`` (its NodeAddr, which resolves even where node names do not), the
port from the job id, and ``--signal=USR1@90`` warns the job 90 s before its time is up, so the
Trainer checkpoints and requeues it. Every user-supplied argument is shell-quoted.

GPUs are read from every way Slurm users ask for them - ``--gpus-per-node [TYPE:]N``, ``--gres
gpu[:TYPE]:N`` and, through ``--sbatch-arg``, ``--gres``, ``--gpus``, ``--gpus-per-node`` and
``--gpus-per-task`` - so a job that holds GPUs always starts one process per GPU instead of training on
the CPU. A job array (:func:`render_array`) runs one run of a runs file per task.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from multigpu import validate
from multigpu.distributed.world import SLURM_PORT_BASE, SLURM_PORT_SPAN
from multigpu.errors import LaunchError
from multigpu.fileio import atomic_write_text, ensure_real_folder
from multigpu.launch import environment
from multigpu.launch.flags import RunFlags
from multigpu.launch.interpreter import python_module
from multigpu.launch.slurm_options import (  # explicit re-exports, for the commands
    CPUS_PER_GPU_PROCESS as CPUS_PER_GPU_PROCESS,
    SQUEUE_NAME_WIDTH as SQUEUE_NAME_WIDTH,
    GpuRequest as GpuRequest,
    SlurmOptions as SlurmOptions,
    sbatch_safe as sbatch_safe,
    short_names as short_names,
    timed_job_name as timed_job_name,
)

SCRIPT_NAME = "job.sbatch"
#: An array job's map from task index to run folder (next to its script), for `multigpu slurm logs`.
TASKS_FILE = "tasks.json"


@dataclass(frozen=True)
class SlurmJob:
    command: tuple[str, ...]  # ("train.py", *args) or ("-m", "pkg.mod", *args)
    run_dir: Path
    options: SlurmOptions = field(default_factory=SlurmOptions)
    workdir: Path = field(default_factory=Path.cwd)
    python: str = sys.executable
    env: tuple[tuple[str, str], ...] = ()
    #: Credentials of the submitting shell not passed to the job (its env names an endpoint).
    unset: tuple[str, ...] = ()
    #: ``multigpu queue --slurm``: the job writes its end state here, with this settings fingerprint.
    status_file: Optional[Path] = None
    fingerprint: str = ""

    @property
    def script_path(self) -> Path:
        return self.run_dir / SCRIPT_NAME

    @property
    def log_pattern(self) -> Path:
        return self.run_dir / "slurm-%j.out"


@dataclass(frozen=True)
class SlurmArray:
    """One array job: task ``i`` runs ``tasks[i]`` (each with its own run folder, status file and log).
    All tasks share ``options`` (nodes, GPUs, processes); ``folder`` holds the script."""

    tasks: Mapping[int, SlurmJob]
    folder: Path
    options: SlurmOptions
    max_parallel: Optional[int] = None
    workdir: Path = field(default_factory=Path.cwd)
    python: str = sys.executable

    @property
    def script_path(self) -> Path:
        return self.folder / SCRIPT_NAME

    @property
    def spec(self) -> str:
        """``0,2,5%2``: the task indices, and at most this many at once."""
        text = ",".join(str(i) for i in sorted(self.tasks))
        return text + (f"%{self.max_parallel}" if self.max_parallel else "")


def _check_folder(folder: Path, what: str) -> None:
    """A folder named in an #SBATCH line (the log's --output): no %, which sbatch expands, and nothing
    :func:`sbatch_safe` refuses (# quotes \\ $ ` whitespace control characters)."""
    hint = "choose a --run-dir (or --out) of plain characters (letters, digits, / . _ -)."
    if "%" in str(folder):
        raise LaunchError(
            f"the {what} {str(folder)[:80]!r} contains %, which #SBATCH lines cannot hold.", hint
        )
    sbatch_safe(str(folder), f"the {what}", hint)


def _check_job(job: SlurmJob) -> None:
    _check_folder(job.run_dir, "run folder")
    for name in job.unset:
        environment.env_name(name, LaunchError)
    for name, value in job.env:
        environment.env_name(name, LaunchError)
        validate.plain_text(value, f"environment variable {name}", LaunchError)
    for part in (*job.command, str(job.workdir), job.python):
        validate.plain_text(part, "an argument of the job", LaunchError)
    if not re.fullmatch(r"[0-9a-f]{0,64}", job.fingerprint):
        raise LaunchError(
            f"fingerprint {job.fingerprint[:20]!r} is not hex.", "this is a bug; please report it."
        )


def _sbatch_lines(o: SlurmOptions, job_name: str, output: Path) -> list[str]:
    sbatch = [
        f"--job-name={job_name}",
        f"--nodes={o.nodes}",
        "--ntasks-per-node=1",
        f"--output={output}",
        "--open-mode=append",
        f"--signal=USR1@{o.signal_seconds}",
    ]
    if o.requeue:
        sbatch.append("--requeue")
    request = o.gpu_request()
    if request is not None and request.line:
        sbatch.append(request.line)
    for flag, value in (
        ("time", o.time),
        ("partition", o.partition),
        ("account", o.account),
        ("qos", o.qos),
        ("constraint", o.constraint),
        ("cpus-per-task", o.cpus_per_task_planned()),
        ("mem", o.mem),
    ):
        if value is not None:
            sbatch.append(f"--{flag}={value}")
    sbatch += list(o.extra)
    # every value was checked at its door; this keeps a new line from skipping it
    for line in sbatch:
        sbatch_safe(
            line, "#SBATCH line", "choose plain values (letters, digits and . _ - : / = , @ %)."
        )
    return [f"#SBATCH {line}" for line in sbatch]


def _launcher(o: SlurmOptions, python: str) -> str:
    """``python -P -m multigpu run ...`` for each node (:mod:`.interpreter`): our $-variables double-quoted (bash expands them),
    everything else single-quoted."""
    flags = RunFlags(
        nnodes="$SLURM_JOB_NUM_NODES",
        nproc=o.processes,
        rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT",
        rdzv_id="$SLURM_JOB_ID",
        cpu=not o.gpus,
        max_restarts=o.max_restarts,
    )
    launcher = [*python_module("multigpu", python), "run", *flags.flags()]
    return " ".join(f'"{part}"' if part.startswith("$") else shlex.quote(part) for part in launcher)


#: The lighthouse's port, like MASTER_PORT from the job id, in a range of its own (never another job's
#: MASTER_PORT on the same first node).
LIGHTHOUSE_PORT_BASE = SLURM_PORT_BASE + SLURM_PORT_SPAN


def _replica_lines(o: SlurmOptions, python: str, target: str) -> list[str]:
    """Replica groups: the lighthouse in the batch script itself - which Slurm runs on the first node -
    bound to that node's address, and one group per node. A group that fails is restarted by its own
    agent while the others keep training, so srun must not kill the job for one task's failure."""
    q = shlex.quote
    groups = f"--replica-groups {o.replica_groups} --min-replicas {o.min_replicas} --heartbeat-timeout {o.heartbeat_timeout:g}"
    module = python_module("multigpu", python)
    flags = RunFlags(
        replica_groups=o.replica_groups,
        min_replicas=o.min_replicas,
        heartbeat_timeout=o.heartbeat_timeout,
        lighthouse="$MASTER_ADDR:$LIGHTHOUSE_PORT",
        nproc=o.processes,
        cpu=not o.gpus,
        max_restarts=o.max_restarts,
    )
    launcher = [*module, "run", *flags.flags()]
    # after "run"
    words = " ".join(
        f'"{part}"' if part.startswith("$") else q(part) for part in launcher[len(module) + 1 :]
    )
    per_node = (
        'addr=$(scontrol show node "$SLURMD_NODENAME" 2>/dev/null | grep -o "NodeAddr=[^ ]*" | cut -d= -f2 '
        f'|| true); exec "$1" {" ".join(q(w) for w in module[1:])} run --replica-group "$SLURM_NODEID" '
        '--local-addr "${addr:-$(hostname)}" "${@:2}"'
    )
    return [
        "# Replica groups (torchft): the lighthouse holds the quorum of every step. It runs here, in the batch",
        "# script, which Slurm starts on the first node, and ends with it.",
        f"LIGHTHOUSE_PORT=$(( {LIGHTHOUSE_PORT_BASE} + ${{SLURM_JOB_ID%%[!0-9]*}} % {SLURM_PORT_SPAN} ))",
        f'{" ".join(map(q, python_module("multigpu.launch.replicas", python)))} --bind "$MASTER_ADDR:$LIGHTHOUSE_PORT" '
        f"{groups} &",
        "lighthouse=$!",
        """trap 'kill "$lighthouse" 2>/dev/null || true' EXIT""",
        'echo "multigpu: lighthouse $MASTER_ADDR:$LIGHTHOUSE_PORT"',
        "",
        "# One replica group per node (its number: the node's index in the job). A group that fails is restarted",
        "# by its own agent and heals from a live one; the others keep training, so no --kill-on-bad-exit.",
        f"srun --kill-on-bad-exit=0 bash -c {q(per_node)} multigpu {q(python)} {words} {target}",
    ]


def _target(command: Sequence[str]) -> list[str]:
    """The script (after ``--``: never read as a launcher flag) or ``-m module``, and its arguments."""
    return list(command) if command and command[0] == "-m" else ["--", *command]


_PREAMBLE = [
    "# The first node hosts the rendezvous. Its NodeAddr resolves even where node names do not.",
    'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
    'MASTER_ADDR=$(scontrol show node "$first_node" 2>/dev/null | grep -o "NodeAddr=[^ ]*" | cut -d= -f2 || true)',
    "MASTER_ADDR=${MASTER_ADDR:-$first_node}",
    # digits only
    f"MASTER_PORT=$(( {SLURM_PORT_BASE} + ${{SLURM_JOB_ID%%[!0-9]*}} % {SLURM_PORT_SPAN} ))",
    "export MASTER_ADDR MASTER_PORT",
    'echo "multigpu: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, '
    'rendezvous $MASTER_ADDR:$MASTER_PORT"',
    "",
]


def _end_state(status_file: str, fingerprint: str, job_id: str) -> list[str]:
    """Lines that write the run's end state for `multigpu queue --slurm`; ``status_file``, ``fingerprint``
    and ``job_id`` are shell words (quoted paths, or double-quoted $-expressions of ours)."""
    return [
        "# The end state for `multigpu queue --slurm` (75: preempted, requeued or resumable), written to a",
        "# fresh temporary file (mktemp: never a name planted in the folder) renamed over status.json.",
        'state=done; [ "$code" -eq 0 ] || state=failed; [ "$code" -ne 75 ] || state=interrupted',
        f'tmp=$(mktemp "$(dirname {status_file})/.status.json.XXXXXXXX")',
        'printf \'{"state": "%s", "exit_code": %d, "job_id": "%s", "fingerprint": "%s"}\\n\' '
        f'"$state" "$code" {job_id} {fingerprint} > "$tmp" && mv -f -T "$tmp" {status_file}',
        'exit "$code"',
        "",
    ]


def render(job: SlurmJob) -> str:
    """The sbatch script, meant to be read: every line says what it is for."""
    o = job.options
    o.validate()
    _check_job(job)
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# Written by `multigpu slurm` on {time.strftime('%Y-%m-%d %H:%M:%S')}. "
        f"Submit with: sbatch {q(str(job.script_path))}",
    ]
    lines += _sbatch_lines(
        o, o.job_name or timed_job_name(job.run_dir.name, time.time()), job.log_pattern
    )
    lines += ["", "set -euo pipefail", f"cd {q(str(job.workdir))}", "", *_PREAMBLE]
    if job.env:
        lines += [
            "# The run's own environment (after the lines above, so nothing of it steers them)."
        ]
        lines += [f"export {name}={q(value)}" for name, value in job.env]
        lines += (
            [
                f"unset {' '.join(job.unset)}  # credentials stay out: this run's env names an endpoint"
            ]
            if job.unset
            else []
        )
        lines += [""]
    target = " ".join(q(part) for part in _target(job.command))
    if o.replica_groups is not None:
        if job.status_file is not None:
            raise LaunchError(
                "replica groups are not run from a runs file.",
                "submit them with `multigpu slurm --replica-groups R`.",
            )
        return "\n".join([*lines, *_replica_lines(o, job.python, target), ""])
    lines += [
        "# One task per node; each starts this node's workers. USR1 (time nearly up) reaches every task:",
        "# the workers checkpoint and rank 0 requeues the job, which then resumes from that checkpoint.",
    ]
    rendered = _launcher(o, job.python) + " " + target
    if job.status_file is None:
        return "\n".join([*lines, f"srun --kill-on-bad-exit=1 {rendered}", ""])
    return "\n".join(
        [
            *lines,
            "code=0",
            f"srun --kill-on-bad-exit=1 {rendered} || code=$?",
            *_end_state(q(str(job.status_file)), job.fingerprint or "''", '"$SLURM_JOB_ID"'),
        ]
    )


def render_array(array: SlurmArray) -> str:
    """One script for every task: a ``case`` on ``SLURM_ARRAY_TASK_ID`` picks the task's run folder (its
    log goes there from the first line on), environment and arguments; the rest is :func:`render`'s."""
    o = array.options
    o.validate()
    if not array.tasks:
        raise LaunchError(
            "an array job needs at least one task.", "this is a bug; please report it."
        )
    if array.max_parallel is not None:
        validate.count(array.max_parallel, "--max-parallel", LaunchError)
    _check_folder(array.folder, "array folder")
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# Written by `multigpu queue --slurm --array` on {time.strftime('%Y-%m-%d %H:%M:%S')}: "
        f"task i runs the i-th run of the runs file. Submit with: sbatch {q(str(array.script_path))}",
    ]
    lines += _sbatch_lines(
        o, o.job_name or array.folder.name[:SQUEUE_NAME_WIDTH], array.folder / "slurm-%A_%a.out"
    )
    lines += [
        f"#SBATCH --array={array.spec}",
        "",
        "set -euo pipefail",
        f"cd {q(str(array.workdir))}",
        "",
        "# Each task: its run folder (the log goes there), its environment and its arguments.",
        'case "${SLURM_ARRAY_TASK_ID:-}" in',
    ]
    for index in sorted(array.tasks):
        task = array.tasks[index]
        _check_job(task)
        if task.status_file is None:
            raise LaunchError(
                "an array task needs a status file.", "this is a bug; please report it."
            )
        lines += [
            f"  {index})",
            f"    folder={q(str(task.run_dir))}",
            '    exec >>"$folder/slurm-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}.out" 2>&1',
            *[f"    export {name}={q(value)}" for name, value in task.env],
            *([f"    unset {' '.join(task.unset)}"] if task.unset else []),
            f"    fingerprint={task.fingerprint}",
            f"    args=({' '.join(q(part) for part in _target(task.command))})",
            "    ;;",
        ]
    lines += [
        '  *) echo "multigpu: array task ${SLURM_ARRAY_TASK_ID:-?} is not one of this script\'s" >&2; exit 2 ;;',
        "esac",
        "",
        *_PREAMBLE,
        "# One task per node; each starts this node's workers (see `multigpu slurm` for USR1 and requeue).",
        "code=0",
        f'srun --kill-on-bad-exit=1 {_launcher(o, array.python)} "${{args[@]}}" || code=$?',
    ]
    lines += _end_state(
        '"$folder/status.json"', '"$fingerprint"', '"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"'
    )
    return "\n".join(lines)


def write(job: SlurmJob) -> Path:
    text = render(job)
    ensure_real_folder(job.run_dir, "run folder")
    atomic_write_text(job.script_path, text, mode=0o755)
    return job.script_path


def write_array(array: SlurmArray) -> Path:
    """The array's script, and next to it the task -> run folder map that `multigpu slurm logs` reads."""
    text = render_array(array)
    ensure_real_folder(array.folder, "array folder")
    atomic_write_text(
        array.folder / TASKS_FILE,
        json.dumps(
            {str(i): str(task.run_dir) for i, task in sorted(array.tasks.items())}, indent=1
        ),
    )
    atomic_write_text(array.script_path, text, mode=0o755)
    return array.script_path


def slurm_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(
            f"`{name}` is not on PATH: this machine is not a Slurm login node.",
            "run on a machine with the Slurm client, or use --dry-run to only write the script.",
        )
    return path


def call(args: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"`{' '.join(args[:2])}` did not answer in {timeout:.0f} s.",
            "is slurmctld reachable? try `sinfo`.",
        ) from None


def submit_script(script: Path) -> str:
    """``sbatch`` a written script; returns the job id."""
    done = call([slurm_tool("sbatch"), "--parsable", str(script)])
    if done.returncode != 0:
        raise LaunchError(
            f"sbatch refused the job: {' '.join(done.stderr.split())[:300]}",
            f"read the script at {script}; check --partition/--account/--time, and --cpus-per-task "
            f"(default {CPUS_PER_GPU_PROCESS} per GPU process) and --mem against the nodes (`sinfo -N -l`).",
        )
    return done.stdout.strip().split(";")[0]


def submit(job: SlurmJob) -> str:
    """Write the script and ``sbatch`` it; returns the job id."""
    return submit_script(write(job))


def check_job_id(job_id: str) -> str:
    """A Slurm job id (``123``, ``123_4`` for an array task, ``123+1`` for a het component), ASCII digits
    only (``\\d`` would let Arabic-Indic digits through to scontrol)."""
    if not re.fullmatch(r"[0-9]{1,12}([_+][0-9]{1,9})?", str(job_id)):
        raise LaunchError(
            f"{str(job_id)[:40]!r} is not a Slurm job id.",
            "give the number sbatch printed, e.g. 12345.",
        )
    return str(job_id)


def parse_scontrol(line: str) -> dict[str, str]:
    """One line of ``scontrol show job -o``. Values hold no spaces except a few (``Command``, ``WorkDir``,
    ``Reason``): a token without ``=`` belongs to the value before it."""
    info: dict[str, str] = {}
    last: Optional[str] = None
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and re.fullmatch(r"[A-Za-z][\w:/.]*", key):
            info[key], last = value, key
        elif last is not None:
            info[last] += " " + token
    return info


def job_infos(job_id: str = "") -> list[dict[str, str]]:
    """``scontrol show job -o [ID]``, one dict per job (an array: one per task); [] if Slurm knows no
    such job. A controller that cannot be reached is an error, not "no such job"."""
    done = call(
        [slurm_tool("scontrol"), "show", "job", "-o", *([check_job_id(job_id)] if job_id else [])]
    )
    if done.returncode != 0:
        text = " ".join(done.stderr.split())
        if "invalid job id" in text.lower():
            return []
        raise LaunchError(
            f"cannot reach the Slurm controller: {text[:200] or f'scontrol exited {done.returncode}'}",
            "check that slurmctld is up (`sinfo`, `scontrol ping`) and retry.",
        )
    return [
        parse_scontrol(line)
        for line in done.stdout.splitlines()
        if line.strip().startswith("JobId=")
    ]


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job`` of one job (JobState, ExitCode, StdOut, Restarts, ...); {} if unknown."""
    infos = job_infos(job_id)
    return infos[0] if infos else {}


#: Job states in which the job still exists in the queue or runs: never submit the same run again.
ACTIVE_STATES = (
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "STAGE_OUT",
    "SIGNALING",
    "RESV_DEL_HOLD",
    "SPECIAL_EXIT",
    "STOPPED",
)


def is_active(job_id: str) -> bool:
    """Still queued or running (scontrol: the controller's own answer, never a stale accounting row)."""
    return job_info(job_id).get("JobState", "") in ACTIVE_STATES


def cancel(job_id: str) -> None:
    done = call([slurm_tool("scancel"), check_job_id(job_id)])
    if done.returncode != 0:
        raise LaunchError(
            f"scancel {job_id} failed: {' '.join(done.stderr.split())[:200]}",
            "check the id with `squeue --me`.",
        )
