"""A Slurm job's options: checked values for the ``#SBATCH`` lines, and the GPUs the job asks for.

Why apart from the script writer (:mod:`multigpu.launch.slurm`): every value here reaches a shell
script, so each is validated on its own terms (numbers as numbers, names against patterns, no control
characters), and the GPUs a job holds are read from every way Slurm users say it - a job that holds
GPUs must never start CPU processes. Short, distinct job names live here too (squeue shows 8 characters).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from multigpu import validate
from multigpu.errors import LaunchError, shown

_TIME = re.compile(r"^([0-9]+-)?[0-9]+(:[0-9]{1,2}){0,2}$")  # ASCII digits only
#: CPU cores asked for each process of a GPU job when --cpus-per-task is not given: its main thread and
#: three data-loading workers. Without it Slurm gives the node's one task a single core for all of them.
CPUS_PER_GPU_PROCESS = 4
#: squeue's default NAME column shows this many characters.
SQUEUE_NAME_WIDTH = 8
_COUNT = r"[0-9]{1,4}"
_GPU_TYPE = r"[A-Za-z0-9_.-]{1,64}"

#: sbatch options that shape the script itself: never through --sbatch-arg (name -> what to use instead).
_STRUCTURAL = {
    "nodes": "--nodes",
    "ntasks": "--nodes and --nproc-per-node",
    "ntasks-per-node": "--nproc-per-node",
    "tasks-per-node": "--nproc-per-node",
    "ntasks-per-gpu": "--nproc-per-node",
    "job-name": "--job-name",
    "output": "nothing (the log goes to the run folder)",
    "error": "nothing (the log goes to the run folder)",
    "open-mode": "nothing (the log is appended to)",
    "signal": "nothing (USR1 90 s before the time limit lets the job checkpoint)",
    "array": "`multigpu queue --slurm --array`",
    "wrap": "a script",
    "gpus-per-socket": "--gpus-per-node (one task per node runs all of them)",
}
#: sbatch options that are flags of ours too: one or the other, never both.
_FIRST_CLASS = ("time", "partition", "account", "qos", "constraint", "mem", "cpus-per-task")
#: sbatch options that ask for GPUs.
_GPU_OPTIONS = ("gres", "gpus", "gpus-per-node", "gpus-per-task")
#: Every long option of sbatch (Slurm 22.05, from its own "is ambiguous; possibilities" lines): getopt_long
#: takes any unique prefix of one as that option (``--j=x`` is --job-name), so --sbatch-arg must resolve
#: them the same way before deciding what an option is.
SBATCH_OPTIONS = (
    "account",
    "acctg-freq",
    "array",
    "batch",
    "bb",
    "bbf",
    "begin",
    "chdir",
    "cluster",
    "cluster-constraint",
    "clusters",
    "comment",
    "constraint",
    "container",
    "context",
    "contiguous",
    "core-spec",
    "cores-per-socket",
    "cpu-freq",
    "cpus-per-gpu",
    "cpus-per-task",
    "deadline",
    "delay-boot",
    "dependency",
    "distribution",
    "error",
    "exclude",
    "exclusive",
    "export",
    "export-file",
    "extra-node-info",
    "get-user-env",
    "gid",
    "gpu-bind",
    "gpu-freq",
    "gpus",
    "gpus-per-node",
    "gpus-per-socket",
    "gpus-per-task",
    "gres",
    "gres-flags",
    "help",
    "hint",
    "hold",
    "ignore-pbs",
    "input",
    "job-name",
    "kill-on-invalid-dep",
    "licenses",
    "mail-type",
    "mail-user",
    "mcs-label",
    "mem",
    "mem-bind",
    "mem-per-cpu",
    "mem-per-gpu",
    "mincpus",
    "network",
    "nice",
    "no-kill",
    "no-requeue",
    "nodefile",
    "nodelist",
    "nodes",
    "ntasks",
    "ntasks-per-core",
    "ntasks-per-gpu",
    "ntasks-per-node",
    "ntasks-per-socket",
    "ntasks-per-tres",
    "open-mode",
    "output",
    "overcommit",
    "oversubscribe",
    "parsable",
    "partition",
    "power",
    "prefer",
    "priority",
    "profile",
    "propagate",
    "qos",
    "quiet",
    "reboot",
    "requeue",
    "reservation",
    "signal",
    "sockets-per-node",
    "spread-job",
    "switches",
    "tasks-per-node",
    "test-only",
    "thread-spec",
    "threads-per-core",
    "time",
    "time-min",
    "tmp",
    "uid",
    "usage",
    "use-min-nodes",
    "verbose",
    "version",
    "wait",
    "wait-all-nodes",
    "wckey",
    "wrap",
)
_KNOWN = tuple(
    dict.fromkeys((*_STRUCTURAL, *_FIRST_CLASS, *_GPU_OPTIONS, "cpus-per-gpu", *SBATCH_OPTIONS))
)
#: What no value of an #SBATCH line may hold: sbatch reads ``#`` as a comment and quotes and ``\`` as its
#: own quoting, ``$`` and backticks read as shell to anyone (or anything) reading the script, and
#: whitespace or a control character (C0, DEL, C1) ends the value or the line.
_SBATCH_UNSAFE = re.compile(r"[#'\"\\$`\s\x00-\x1f\x7f-\x9f]")


def sbatch_safe(value: str, what: str, hint: str) -> str:
    """``value`` if it can stand in an #SBATCH line as it is; else one line naming ``what`` and the character."""
    bad = _SBATCH_UNSAFE.search(value)
    if bad is not None:
        raise LaunchError(
            f"{what} {shown(value, 80)} holds {shown(bad.group())}, which an #SBATCH line cannot hold "
            "(# ' \" \\ $ ` whitespace and control characters are refused).",
            hint,
        )
    return value


def sbatch_option(name: str, arg: str) -> str:
    """The sbatch option ``--name`` stands for: itself, or the one option it is a unique prefix of (as
    sbatch's getopt_long reads it). An ambiguous prefix is refused, with the candidates; a name that is
    no prefix of a known option is passed on as it is (a newer sbatch may know it; sbatch refuses it if not)."""
    if name in _KNOWN:
        return name
    candidates = [option for option in _KNOWN if option.startswith(name)]
    if len(candidates) > 1:
        raise LaunchError(
            f"--sbatch-arg={arg[:60]}: --{name} is ambiguous for sbatch: it could be "
            f"{', '.join('--' + c for c in sorted(candidates)[:12])}.",
            "write the option's full name, e.g. --sbatch-arg=--qos=high.",
        )
    return candidates[0] if candidates else name


@dataclass(frozen=True)
class GpuRequest:
    """GPUs per node as the job asks for them, and where that was said."""

    per_node: int
    source: str  # e.g. "--gpus-per-node 4" or "--sbatch-arg=--gres=gpu:a100:4"
    #: The #SBATCH option to write, or None when the user's own --sbatch-arg line already asks.
    line: Optional[str]


@dataclass(frozen=True)
class SlurmOptions:
    nodes: int = 1
    gpus_per_node: Optional[int] = None  # None: see gpu_request(); 0: a CPU job
    gpu_type: Optional[str] = None  # --gpus-per-node a100:4
    gres: Optional[str] = None  # --gres gpu:a100:4 (only GPU gres: other gres through --sbatch-arg)
    nproc_per_node: Optional[int] = None  # default: one per GPU, or 1 on CPU nodes
    time: Optional[str] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    # default: derived from the processes (see cpus_per_task_planned)
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    job_name: Optional[str] = None
    max_restarts: int = 0
    signal_seconds: int = 90
    requeue: bool = True
    extra: tuple[str, ...] = ()  # further #SBATCH lines, e.g. ("--qos=high",)
    #: Replica groups (torchft): one group per node, the lighthouse on the first node (None: none).
    replica_groups: Optional[int] = None
    min_replicas: int = 1
    heartbeat_timeout: float = 5.0

    def validate(self) -> None:
        """Every value that reaches the script: numbers as numbers in bounds, names as names, no
        control characters (a newline would end the #SBATCH block and start a shell line)."""
        validate.count(self.nodes, "--nodes", LaunchError, high=validate.MAX_NODES)
        if self.gpus_per_node is not None:
            validate.count(
                self.gpus_per_node,
                "--gpus-per-node",
                LaunchError,
                low=0,
                hint="use 0 on CPU nodes.",
            )
        if self.nproc_per_node is not None:
            validate.count(self.nproc_per_node, "--nproc-per-node", LaunchError)
        if self.cpus_per_task is not None:
            validate.count(self.cpus_per_task, "--cpus-per-task", LaunchError)
        validate.count(self.max_restarts, "--max-restarts", LaunchError, low=0, high=1000)
        validate.count(self.signal_seconds, "signal_seconds", LaunchError, high=3600)
        checks = (
            ("--time", self.time, _TIME.pattern.strip("^$"), "20:00:00"),
            ("--partition", self.partition, r"[A-Za-z0-9_.,:+-]{1,200}", "gpu"),
            ("--account", self.account, r"[A-Za-z0-9_.:+-]{1,200}", "myproject"),
            ("--qos", self.qos, r"[A-Za-z0-9_.+-]{1,200}", "high"),
            ("--constraint", self.constraint, r"[A-Za-z0-9_.,:&|\[\]()*+-]{1,200}", "a100|h100"),
            ("--mem", self.mem, r"[0-9]{1,12}(\.[0-9]+)?[KMGTkmgt]?[Bb]?", "64G"),
            ("--job-name", self.job_name, r"[A-Za-z0-9_.+-]{1,200}", "train"),
            ("--gpus-per-node type", self.gpu_type, _GPU_TYPE, "a100:4"),
            ("--gres", self.gres, rf"gpu(:{_GPU_TYPE})?(:{_COUNT})?", "gpu:4 or gpu:a100:4"),
        )
        for flag, value, pattern, example in checks:
            if value is not None:
                validate.plain_text(
                    value, flag, LaunchError, allow_space=False, pattern=pattern, example=example
                )
        for arg in self.extra:
            validate.plain_text(
                arg,
                "--sbatch-arg",
                LaunchError,
                allow_space=False,
                pattern=r"--[A-Za-z][A-Za-z0-9-]*(=\S*)?",
                example="--qos=high (the long form)",
            )
            sbatch_safe(
                arg,
                "--sbatch-arg",
                "give plain values, e.g. --sbatch-arg=--mail-type=END; a value that needs "
                "quoting belongs in a script of your own (sbatch would read it differently from the shell).",
            )
        self.extra_options()
        self.gpu_request()
        if self.replica_groups is not None:
            from multigpu.launch.replicas import ReplicaSettings

            ReplicaSettings(self.replica_groups, self.min_replicas, self.heartbeat_timeout).check()
            if self.replica_groups != self.nodes:
                raise LaunchError(
                    f"--replica-groups {self.replica_groups} with --nodes {self.nodes}: under Slurm each "
                    "node runs one replica group.",
                    f"use --nodes {self.replica_groups} (and "
                    "--gpus-per-node for the processes of each group).",
                )

    def extra_options(self) -> dict[str, str]:
        """The --sbatch-arg options by their full name (sbatch accepts unique abbreviations: they count
        as the option they stand for). Options that shape the script are refused, and so is an option
        given both as our flag and through --sbatch-arg."""
        found: dict[str, str] = {}
        for arg in self.extra:
            name, _, value = arg[2:].partition("=")
            full = sbatch_option(name, arg)
            if full in _STRUCTURAL:
                raise LaunchError(
                    f"--sbatch-arg={arg[:60]} sets --{full}, which the script sets itself.",
                    f"use {_STRUCTURAL[full]} instead.",
                )
            if full in found:
                raise LaunchError(f"--sbatch-arg gives --{full} twice.", "give each option once.")
            if full in _FIRST_CLASS and getattr(self, full.replace("-", "_")) is not None:
                raise LaunchError(
                    f"--{full} is given both as a flag and as --sbatch-arg={arg[:60]}.",
                    f"give it once, as --{full} (checked and shown in the script).",
                )
            found[full] = value
        return found

    def gpu_request(self) -> Optional[GpuRequest]:
        """GPUs per node, from whichever way they were asked for (None: not asked; the queue then uses
        each run's gpus). Asked twice, or in a way that does not split evenly over the nodes: an error."""
        asked: list[GpuRequest] = []
        if self.gpus_per_node is not None:
            typed = f"{self.gpu_type}:" if self.gpu_type else ""
            line = f"--gpus-per-node={typed}{self.gpus_per_node}" if self.gpus_per_node else None
            asked.append(
                GpuRequest(self.gpus_per_node, f"--gpus-per-node {typed}{self.gpus_per_node}", line)
            )
        if self.gres is not None:
            asked.append(
                GpuRequest(
                    _gres_gpus(self.gres, "--gres"), f"--gres {self.gres}", f"--gres={self.gres}"
                )
            )
        for name, value in self.extra_options().items():
            if name in _GPU_OPTIONS:
                asked.append(
                    GpuRequest(
                        self._extra_gpus(name, value), f"--sbatch-arg=--{name}={value}", None
                    )
                )
        if len(asked) > 1:
            raise LaunchError(
                f"GPUs are asked for twice: {asked[0].source} and {asked[1].source}.",
                "ask once, e.g. --gpus-per-node 4 (or --gres gpu:a100:4 for a GPU type).",
            )
        return asked[0] if asked else None

    def _extra_gpus(self, name: str, value: str) -> int:
        flag = f"--sbatch-arg=--{name}={value}"
        if name == "gres":
            return _gres_gpus(value, flag)
        match = re.fullmatch(rf"(?:{_GPU_TYPE}:)?({_COUNT})", value)
        if not match:
            raise LaunchError(
                f"{flag[:80]}: cannot read a GPU count.", f"write --{name}=4 or --{name}=a100:4."
            )
        count = int(match.group(1))
        if name != "gpus":  # per node, or per task with one task per node
            return count
        if count % self.nodes:
            raise LaunchError(
                f"{flag} asks for {count} GPUs in all, which {self.nodes} nodes cannot share evenly.",
                "ask per node instead: --gpus-per-node N.",
            )
        return count // self.nodes

    @property
    def gpus(self) -> int:
        """GPUs per node (0: a CPU job)."""
        request = self.gpu_request()
        return request.per_node if request else (self.gpus_per_node or 0)

    @property
    def processes(self) -> int:
        return self.nproc_per_node or (self.gpus or 1)

    def cpus_per_task_planned(self) -> Optional[int]:
        """--cpus-per-task as given, else derived: CPUS_PER_GPU_PROCESS per process of a GPU job, one per
        process of a CPU job (None when --sbatch-arg asks for CPUs itself)."""
        if self.cpus_per_task is not None:
            return self.cpus_per_task
        if {"cpus-per-task", "cpus-per-gpu"} & set(self.extra_options()):
            return None
        return self.processes * (CPUS_PER_GPU_PROCESS if self.gpus else 1)


def _gres_gpus(value: str, flag: str) -> int:
    """The GPUs per node of a --gres value (``gpu``, ``gpu:4``, ``gpu:a100:4``, ``gpu:4,nic:1``)."""
    counts = []
    for item in value.split(","):
        parts = item.split(":")
        if parts[0] != "gpu":
            continue
        # gpu, gpu:a100: one
        count = parts[-1] if len(parts) > 1 and re.fullmatch(_COUNT, parts[-1]) else "1"
        typed = parts[1:-1] if count == parts[-1] else parts[1:]
        if len(typed) > 1 or not all(re.fullmatch(_GPU_TYPE, t) for t in typed):
            raise LaunchError(
                f"{flag} {value[:60]!r}: cannot read {item[:30]!r} as GPUs.",
                "write gpu:4 or gpu:a100:4 (GPUs per node).",
            )
        counts.append(int(count))
    if len(counts) > 1:
        raise LaunchError(f"{flag} {value[:60]!r} names gpu twice.", "write gpu:N once.")
    return counts[0] if counts else 0


def _base36(number: int, width: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    for _ in range(width):
        number, rest = divmod(number, 36)
        out = digits[rest] + out
    return out


def _name_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "", text)[:4] or "job"


def timed_job_name(stem: str, when: float) -> str:
    """``trai-k3f``: 4 characters of the script's name and 3 that change every second (repeating after
    13 hours), so two jobs submitted a second apart differ within squeue's 8-character NAME column."""
    return f"{_name_part(stem)}-{_base36(int(when), 3)}"


def short_names(names: Sequence[str]) -> dict[str, str]:
    """A distinct job name of at most 8 characters for each run name: the name itself when it fits,
    else 4 of its characters and 3 from a hash of it - the same each time the runs file is submitted."""
    out: dict[str, str] = {}
    taken = {name for name in names if len(name) <= SQUEUE_NAME_WIDTH}
    for name in names:
        if len(name) <= SQUEUE_NAME_WIDTH:
            out[name] = name
            continue
        salt = 0
        while True:
            digest = int(hashlib.sha256(f"{name}:{salt}".encode()).hexdigest(), 16)
            short = f"{_name_part(name)}-{_base36(digest, 3)}"
            if short not in taken:
                break
            salt += 1
        taken.add(short)
        out[name] = short
    return out
