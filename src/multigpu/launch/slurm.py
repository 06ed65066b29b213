"""``multigpu slurm``: write a readable sbatch script into the run folder, submit it, follow the job.

The script is the sbatch + srun recipe of SpeechBrain's multi-GPU guide in one: one task per node, each running
``multigpu run`` with a c10d rendezvous on the first node. The master address comes from the node
list through ``scontrol show node`` (its NodeAddr, which resolves even where node names do not), the
port from the job id, and ``--signal=USR1@90`` warns the job 90 s before its time is up, so the
Trainer checkpoints and requeues it. Every user-supplied argument is shell-quoted.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from multigpu import validate
from multigpu.errors import LaunchError
from multigpu.fileio import atomic_write_text, ensure_real_folder, tail_lines
from multigpu.distributed.world import SLURM_PORT_BASE, SLURM_PORT_SPAN

SCRIPT_NAME = "job.sbatch"
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


@dataclass(frozen=True)
class SlurmOptions:
    nodes: int = 1
    gpus_per_node: Optional[int] = None  # None: 0 for `multigpu slurm`, each run's gpus for the queue
    nproc_per_node: Optional[int] = None  # default: one per GPU, or 1 on CPU nodes
    time: Optional[str] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    job_name: Optional[str] = None
    max_restarts: int = 0
    signal_seconds: int = 90
    requeue: bool = True
    extra: tuple[str, ...] = ()  # further #SBATCH lines, e.g. ("--qos=high",)

    def validate(self) -> None:
        """Every value that reaches the script: numbers as numbers in bounds, names as names, no
        control characters (a newline would end the #SBATCH block and start a shell line)."""
        validate.count(self.nodes, "--nodes", LaunchError, high=validate.MAX_NODES)
        if self.gpus_per_node is not None:
            validate.count(self.gpus_per_node, "--gpus-per-node", LaunchError, low=0, hint="use 0 on CPU nodes.")
        if self.nproc_per_node is not None:
            validate.count(self.nproc_per_node, "--nproc-per-node", LaunchError)
        if self.cpus_per_task is not None:
            validate.count(self.cpus_per_task, "--cpus-per-task", LaunchError)
        validate.count(self.max_restarts, "--max-restarts", LaunchError, low=0, high=1000)
        validate.count(self.signal_seconds, "signal_seconds", LaunchError, high=3600)
        checks = (("--time", self.time, _TIME.pattern.strip("^$"), "20:00:00"),
                  ("--partition", self.partition, r"[A-Za-z0-9_.,:+-]{1,200}", "gpu"),
                  ("--account", self.account, r"[A-Za-z0-9_.:+-]{1,200}", "myproject"),
                  ("--mem", self.mem, r"\d{1,12}(\.\d+)?[KMGTkmgt]?[Bb]?", "64G"),
                  ("--job-name", self.job_name, r"[A-Za-z0-9_.+-]{1,200}", "train"))
        for flag, value, pattern, example in checks:
            if value is not None:
                validate.plain_text(value, flag, LaunchError, allow_space=False, pattern=pattern, example=example)
        for arg in self.extra:
            validate.plain_text(arg, "--sbatch-arg", LaunchError, allow_space=False,
                                pattern=r"--?[A-Za-z][A-Za-z0-9-]*(=\S*)?", example="--qos=high")

    @property
    def processes(self) -> int:
        return self.nproc_per_node or (self.gpus_per_node or 1)


@dataclass(frozen=True)
class SlurmJob:
    command: tuple[str, ...]  # ("train.py", *args) or ("-m", "pkg.mod", *args)
    run_dir: Path
    options: SlurmOptions = field(default_factory=SlurmOptions)
    workdir: Path = field(default_factory=Path.cwd)
    python: str = sys.executable
    env: tuple[tuple[str, str], ...] = ()
    #: ``multigpu queue --slurm``: the job writes its end state here, with this settings fingerprint.
    status_file: Optional[Path] = None
    fingerprint: str = ""

    @property
    def script_path(self) -> Path:
        return self.run_dir / SCRIPT_NAME

    @property
    def log_pattern(self) -> Path:
        return self.run_dir / "slurm-%j.out"


def render(job: SlurmJob) -> str:
    """The sbatch script, meant to be read: every line says what it is for."""
    o = job.options
    o.validate()
    if re.search(r"[\s%\x00-\x1f\x7f]", str(job.run_dir)):
        raise LaunchError(f"the run folder {str(job.run_dir)[:80]!r} contains whitespace, % or control characters, "
                          "which #SBATCH lines cannot hold.", "choose a --run-dir of plain characters.")
    for name, value in job.env:
        validate.env_name(name, LaunchError)
        validate.plain_text(value, f"environment variable {name}", LaunchError)
    for part in (*job.command, str(job.workdir), job.python):
        validate.plain_text(part, "an argument of the job", LaunchError)
    q = shlex.quote
    lines = ["#!/bin/bash", f"# Written by `multigpu slurm` on {time.strftime('%Y-%m-%d %H:%M:%S')}. Submit with: sbatch {q(str(job.script_path))}"]
    sbatch = [f"--job-name={o.job_name or job.run_dir.name}", f"--nodes={o.nodes}", "--ntasks-per-node=1",
              f"--output={job.log_pattern}", "--open-mode=append", f"--signal=USR1@{o.signal_seconds}"]
    if o.requeue:
        sbatch.append("--requeue")
    if o.gpus_per_node:
        sbatch.append(f"--gpus-per-node={o.gpus_per_node}")
    for flag, value in (("time", o.time), ("partition", o.partition), ("account", o.account),
                        ("cpus-per-task", o.cpus_per_task), ("mem", o.mem)):
        if value is not None:
            sbatch.append(f"--{flag}={value}")
    sbatch += list(o.extra)
    lines += [f"#SBATCH {line}" for line in sbatch]
    launcher = [job.python, "-m", "multigpu", "run", "--nnodes", "$SLURM_JOB_NUM_NODES",
                "--nproc", str(o.processes), "--rdzv-endpoint", "$MASTER_ADDR:$MASTER_PORT", "--rdzv-id", "$SLURM_JOB_ID"]
    if not o.gpus_per_node:
        launcher.append("--cpu")
    if o.max_restarts:
        launcher += ["--max-restarts", str(o.max_restarts)]
    if job.command and job.command[0] != "-m":
        launcher.append("--")  # the script and its arguments are never read as launcher flags
    # $-variables of the launcher line are ours (double-quoted, expanded by bash); the user's
    # arguments are single-quoted: they arrive exactly as typed and run nothing.
    rendered = " ".join(f'"{part}"' if part.startswith("$") else q(part) for part in launcher)
    rendered += " " + " ".join(q(part) for part in job.command)
    lines += [
        "",
        "set -euo pipefail",
        f"cd {q(str(job.workdir))}",
        "",
        "# The first node hosts the rendezvous. Its NodeAddr resolves even where node names do not.",
        'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'MASTER_ADDR=$(scontrol show node "$first_node" 2>/dev/null | grep -o "NodeAddr=[^ ]*" | cut -d= -f2 || true)',
        'MASTER_ADDR=${MASTER_ADDR:-$first_node}',
        f'MASTER_PORT=$(( {SLURM_PORT_BASE} + ${{SLURM_JOB_ID%%[!0-9]*}} % {SLURM_PORT_SPAN} ))',  # digits only
        "export MASTER_ADDR MASTER_PORT",
        'echo "multigpu: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, '
        'rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "",
        *(["# The run's own environment (after the lines above, so nothing of it steers them)."]
          + [f"export {name}={q(value)}" for name, value in job.env] if job.env else []),
        "",
        "# One task per node; each starts this node's workers. USR1 (time nearly up) reaches every task:",
        "# the workers checkpoint and rank 0 requeues the job, which then resumes from that checkpoint.",
    ]
    if job.status_file is None:
        lines += [f"srun --kill-on-bad-exit=1 {rendered}", ""]
        return "\n".join(lines)
    if not re.fullmatch(r"[0-9a-f]{0,64}", job.fingerprint):
        raise LaunchError(f"fingerprint {job.fingerprint[:20]!r} is not hex.", "this is a bug; please report it.")
    tmp, final = q(str(job.status_file) + ".tmp"), q(str(job.status_file))
    lines += [
        "code=0",
        f"srun --kill-on-bad-exit=1 {rendered} || code=$?",
        "# The end state for `multigpu queue --slurm` (75: preempted, requeued or resumable).",
        'state=done; [ "$code" -eq 0 ] || state=failed; [ "$code" -ne 75 ] || state=interrupted',
        f"printf '{{\"state\": \"%s\", \"exit_code\": %d, \"job_id\": \"%s\", \"fingerprint\": "
        f"\"{job.fingerprint}\"}}\\n' \"$state\" \"$code\" \"$SLURM_JOB_ID\" > {tmp} && mv {tmp} {final}",
        'exit "$code"',
        "",
    ]
    return "\n".join(lines)


def write(job: SlurmJob) -> Path:
    text = render(job)
    ensure_real_folder(job.run_dir, "run folder")
    atomic_write_text(job.script_path, text)
    job.script_path.chmod(0o755)
    return job.script_path


def _slurm_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"`{name}` is not on PATH: this machine is not a Slurm login node.",
                          "run on a machine with the Slurm client, or use --dry-run to only write the script.")
    return path


def _call(args: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{' '.join(args[:2])}` did not answer in {timeout:.0f} s.",
                          "is slurmctld reachable? try `sinfo`.") from None


def submit(job: SlurmJob) -> str:
    """Write the script and ``sbatch`` it; returns the job id."""
    script = write(job)
    done = _call([_slurm_tool("sbatch"), "--parsable", str(script)])
    if done.returncode != 0:
        raise LaunchError(f"sbatch refused the job: {' '.join(done.stderr.split())[:300]}",
                          f"read the script at {script}; check --partition/--account/--time.")
    return done.stdout.strip().split(";")[0]


def check_job_id(job_id: str) -> str:
    """A Slurm job id (``123``, ``123_4`` for an array task, ``123+1`` for a het component)."""
    if not re.fullmatch(r"\d{1,12}([_+]\d{1,9})?", str(job_id)):
        raise LaunchError(f"{str(job_id)[:40]!r} is not a Slurm job id.", "give the number sbatch printed, e.g. 12345.")
    return str(job_id)


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, ExitCode, StdOut, Restarts, ...); {} if Slurm knows no
    such job. A controller that cannot be reached is an error, not "no such job"."""
    done = _call([_slurm_tool("scontrol"), "show", "job", "-o", check_job_id(job_id)])
    if done.returncode != 0:
        text = " ".join(done.stderr.split())
        if "invalid job id" in text.lower():
            return {}
        raise LaunchError(f"cannot reach the Slurm controller: {text[:200] or f'scontrol exited {done.returncode}'}",
                          "check that slurmctld is up (`sinfo`, `scontrol ping`) and retry.")
    info = {}
    for token in done.stdout.split():
        key, sep, value = token.partition("=")
        if sep:
            info[key] = value
    return info


#: Job states in which the job still exists in the queue or runs: never submit the same run again.
ACTIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                 "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD", "SPECIAL_EXIT", "STOPPED")


def is_active(job_id: str) -> bool:
    return job_info(job_id).get("JobState", "") in ACTIVE_STATES


def status(job_id: str) -> str:
    info = job_info(job_id)
    if not info:
        raise LaunchError(f"Slurm knows no job {job_id}.", "check the id with `squeue --me`; finished jobs are "
                          "forgotten after MinJobAge.")
    return (f"job {job_id} ({info.get('JobName', '?')}): {info.get('JobState', '?')}, exit {info.get('ExitCode', '?')}, "
            f"restarts {info.get('Restarts', '0')}, nodes {info.get('NodeList', '?')}, elapsed {info.get('RunTime', '?')}, "
            f"log {info.get('StdOut', '?')}")


def log_path(job_id: str) -> Path:
    info = job_info(job_id)
    if not info or "StdOut" not in info:
        raise LaunchError(f"Slurm knows no job {job_id}.", "check the id with `squeue --me`.")
    return Path(info["StdOut"].replace("%j", str(job_id)))


def log_tail(job_id: str, lines: int = 50) -> tuple[Path, list[str], int]:
    """(log path, its last ``lines`` lines, the number of lines) - read from the end, whatever its size."""
    path = log_path(job_id)
    if not path.is_file():
        raise LaunchError(f"job {job_id} has no log yet at {path}.", "it may still be pending: `multigpu slurm status`.")
    tail, total = tail_lines(path, lines)
    return path, tail, total


def cancel(job_id: str) -> None:
    done = _call([_slurm_tool("scancel"), check_job_id(job_id)])
    if done.returncode != 0:
        raise LaunchError(f"scancel {job_id} failed: {' '.join(done.stderr.split())[:200]}",
                          "check the id with `squeue --me`.")
