"""Every flag of one launch, declared once: its spellings, type, default, bounds and help.

Why: a flag used to be spelled in the parser, again in the command lines other commands write
(``RunFlags``'s fields, its table of flags, its table of defaults) and again where it is checked; one
renamed in one place silently dropped out of another. From :data:`KNOBS` come ``multigpu run``'s parser
(and ``doctor``'s device and node flags), the bounds each value is checked against before anything
starts, and :class:`multigpu.launch.flags.RunFlags` - the ``multigpu run`` line the queue, ``check``,
``doctor``, ``--simulate-nodes``, replica groups and Slurm scripts write. A new launch flag is one
:class:`Knob` here plus its use.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from multigpu import validate
from multigpu.errors import EXIT_STUCK_AT_EXIT, LaunchError
from multigpu.launch.exit_watch import EXIT_TIMEOUT_S
from multigpu.launch.process import STOP_TIMEOUT_S
from multigpu.validate import whole_flag

Check = Callable[[Any, str], object]

DEVICES, NODES, LOGS = "devices and processes", "several machines", "failures and logs"
REPLICAS = (
    "replica groups: keep training when a group dies (needs torchft: pip install 'multigpu[ft]'; "
    "docs/fault-tolerance.md)"
)
TORCHRUN = "torchrun's flags (accepted in both spellings, so torchrun lines work unchanged)"


@dataclass(frozen=True)
class Knob:
    """One launch flag. ``handed_on``: written into the ``multigpu run`` lines other commands start
    (a flag that only shapes this command line, ``--fresh``, is not)."""

    name: str
    flags: tuple[str, ...]
    group: str
    help: str
    default: Any = None
    type: Optional[Callable[[str], Any]] = None
    metavar: Optional[str] = None
    choices: Optional[tuple[str, ...]] = None
    switch: bool = False
    handed_on: bool = True
    check: Optional[Check] = None

    def spellings(self) -> list[str]:
        """Ours and torchrun's: ``--nproc-per-node`` and ``--nproc_per_node``."""
        return spellings(*self.flags)

    def add_to(
        self, group: "argparse._ActionsContainer", default: Any = None, help: Optional[str] = None
    ) -> None:
        """This flag in ``group``; ``default``/``help``: another command's own (``slurm submit``'s)."""
        if self.switch:
            group.add_argument(
                *self.spellings(), dest=self.name, action="store_true", help=help or self.help
            )
            return
        typed: dict[str, Any] = {"type": self.type} if self.type is not None else {}
        group.add_argument(
            *self.spellings(),
            dest=self.name,
            default=self.default if default is None else default,
            metavar=self.metavar,
            choices=self.choices,
            help=help or self.help,
            **typed,
        )


def spellings(*names: str) -> list[str]:
    """A flag in our spelling and in torchrun's: ``--nproc-per-node`` and ``--nproc_per_node``."""
    out: list[str] = []
    for name in names:
        out.append(name)
        if name.startswith("--") and "-" in name[2:]:
            out.append("--" + name[2:].replace("-", "_"))
    return out


def nproc_value(text: str) -> "int | str":
    """``--nproc``: a number, or torchrun's ``auto``/``gpu``/``cpu`` (resolved when devices are planned)."""
    if text in ("auto", "gpu", "cpu"):
        return text
    # a count below 1: said by the device planner
    if text.startswith("-") and validate.is_digits(text[1:]):
        return -int(text[1:])
    if not validate.is_digits(text):  # int() would take "١٢" and "1_000"
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is not a number of processes, auto, gpu or cpu"
        )
    return int(text)


def _count(low: int, high: int, hint: Optional[str] = None) -> Check:
    return lambda value, flag: validate.count(
        value, flag, LaunchError, low=low, high=high, hint=hint
    )


def _seconds(value: Any, flag: str) -> object:
    return validate.positive_seconds(value, flag, LaunchError)


def _interval(value: Any, flag: str) -> object:
    """Seconds between polls: a busy loop below a hundredth of a second."""
    if _seconds(value, flag) and value < 0.01:
        raise LaunchError(
            f"{flag} {value!r} is shorter than 0.01 s (a busy loop).", f"e.g. {flag} 0.1."
        )
    return value


def _address(example: str) -> Check:
    return lambda value, flag: validate.plain_text(
        value, flag, LaunchError, allow_space=False, pattern=r"[\w.:\[\]%-]{1,255}", example=example
    )


KNOBS: tuple[Knob, ...] = (
    Knob(
        "gpus",
        ("--gpus",),
        DEVICES,
        "GPUs to use, e.g. 0,2,3 or 0-3 (default: every visible GPU)",
        metavar="IDS",
    ),
    Knob(
        "nproc",
        ("--nproc", "--nproc-per-node"),
        DEVICES,
        "processes on this machine (default: one per GPU, or 1 "
        "on a CPU machine); torchrun's auto, gpu and cpu work too",
        type=nproc_value,
        metavar="N",
    ),
    Knob(
        "gpus_per_proc",
        ("--gpus-per-proc",),
        DEVICES,
        "GPUs owned by each process, for model-parallel strategies (default 1)",
        1,
        whole_flag,
        "K",
    ),
    Knob(
        "procs_per_gpu",
        ("--procs-per-gpu",),
        DEVICES,
        "processes sharing each GPU, talking over gloo (NCCL refuses "
        "two ranks on one GPU); for small models and for testing the multi-process path on one GPU (default 1)",
        1,
        whole_flag,
        "K",
    ),
    Knob(
        "cpu",
        ("--cpu",),
        DEVICES,
        "use CPU processes even where GPUs are visible",
        False,
        switch=True,
    ),
    Knob(
        "nnodes", ("--nnodes",), NODES, "number of machines (default 1)", "1", metavar="N|MIN:MAX"
    ),
    Knob(
        "node_rank",
        ("--node-rank",),
        NODES,
        "this machine's index, 0..nnodes-1 (static rendezvous)",
        0,
        whole_flag,
        "R",
        check=_count(0, validate.MAX_NODES),
    ),
    Knob(
        "master_addr",
        ("--master-addr",),
        NODES,
        "address of node 0, reachable from every node",
        metavar="HOST",
    ),
    Knob(
        "master_port",
        ("--master-port",),
        NODES,
        "port on node 0 (default on one machine: a free port is chosen)",
        type=whole_flag,
        metavar="PORT",
        check=_count(1, 65535, "use a port from 1 to 65535 (below 1024 only as root)."),
    ),
    Knob(
        "rdzv_endpoint",
        ("--rdzv-endpoint",),
        NODES,
        "c10d rendezvous (elastic --nnodes MIN:MAX)",
        metavar="HOST:PORT",
    ),
    Knob(
        "rdzv_id",
        ("--rdzv-id",),
        NODES,
        "job id shared by every node of a c10d rendezvous",
        metavar="ID",
    ),
    Knob(
        "rdzv_timeout",
        ("--rdzv-timeout",),
        NODES,
        "seconds to wait for every node to join (default %(default)s)",
        900,
        whole_flag,
        "S",
        check=_seconds,
    ),
    Knob(
        "simulate_nodes",
        ("--simulate-nodes",),
        NODES,
        "rehearse an N-node job on this machine: N agents on loopback (GPUs split evenly)",
        type=whole_flag,
        metavar="N",
    ),
    Knob(
        "max_restarts",
        ("--max-restarts",),
        LOGS,
        "restart all workers up to K times when one fails (default 0)",
        0,
        whole_flag,
        "K",
        check=_count(0, 1000),
    ),
    Knob(
        "stop_timeout",
        ("--stop-timeout", "--shutdown-timeout"),
        LOGS,
        "on SIGTERM/SIGUSR1, seconds the workers "
        f"get to checkpoint before SIGKILL (default {STOP_TIMEOUT_S}; torchrun calls it --shutdown-timeout)",
        STOP_TIMEOUT_S,
        whole_flag,
        "S",
        check=_seconds,
    ),
    Knob(
        "exit_timeout",
        ("--exit-timeout",),
        LOGS,
        "a worker still alive S seconds after every rank here finished "
        "its script has its Python stacks written to the log folder and is ended; exit "
        f"{EXIT_STUCK_AT_EXIT} (default {EXIT_TIMEOUT_S})",
        EXIT_TIMEOUT_S,
        whole_flag,
        "S",
        check=_seconds,
    ),
    Knob(
        "log_dir",
        ("--log-dir",),
        LOGS,
        "keep each rank's stderr and stdout here, rankN.attemptK.stderr/.stdout "
        "(default: stderr only, in a temporary folder removed after a successful run)",
        metavar="DIR",
    ),
    Knob(
        "tee_prefix",
        ("--tee-prefix",),
        LOGS,
        "put [rankN] before each line of the workers' stderr: auto (not on "
        "a terminal, where progress bars redraw in place; yes in log files with several ranks), always or never",
        "auto",
        choices=("auto", "always", "never"),
    ),
    Knob(
        "fresh",
        ("--fresh",),
        LOGS,
        "start a new run of the recipe in a folder without checkpoints (its trainer.fresh=true)",
        False,
        switch=True,
        handed_on=False,
    ),
    Knob(
        "resume",
        ("--resume",),
        LOGS,
        "start the recipe from this checkpoint: a run folder, its checkpoints folder "
        "or a step-N folder (its trainer.resume_from=PATH)",
        metavar="PATH",
        handed_on=False,
    ),
    Knob(
        "verbose",
        ("--verbose",),
        LOGS,
        "show torch elastic's own log lines (and the launcher's C++ logs)",
        False,
        switch=True,
    ),
    Knob(
        "debug",
        ("--debug",),
        LOGS,
        "TORCH_DISTRIBUTED_DEBUG=DETAIL, NCCL_DEBUG=INFO and the NCCL flight recorder "
        "(dumped into the log folder on a timeout); keeps every rank's log",
        False,
        switch=True,
    ),
    Knob(
        "profile",
        ("--profile",),
        LOGS,
        "the Trainer traces steps 3-5 with torch.profiler: one trace per rank in "
        "out_dir/profile, rank 0's top operators printed (the trainer setting profile: tunes it)",
        False,
        switch=True,
    ),
    Knob(
        "replica_groups",
        ("--replica-groups",),
        REPLICAS,
        "R groups of --nproc processes each, on torchft's "
        "fault-tolerant DDP (strategy ft-ddp): a group that dies is left out of the next steps, restarted by its "
        "agent (--max-restarts) and heals from a live group; a lighthouse in this launcher holds the quorum of "
        "each step",
        type=whole_flag,
        metavar="R",
    ),
    Knob(
        "min_replicas",
        ("--min-replicas",),
        REPLICAS,
        "the fewest live groups a step needs (default 1)",
        1,
        whole_flag,
        "M",
        check=_count(1, 1024),
    ),
    Knob(
        "heartbeat_timeout",
        ("--heartbeat-timeout",),
        REPLICAS,
        "seconds a silent group is waited for before the "
        "others go on without it: the pause per failure (default 5)",
        5.0,
        float,
        "S",
        check=_seconds,
    ),
    Knob(
        "replica_group",
        ("--replica-group",),
        REPLICAS,
        "run only group G of --replica-groups R on this machine, "
        "joining --lighthouse (what `multigpu slurm --replica-groups` runs on each node)",
        type=whole_flag,
        metavar="G",
    ),
    Knob(
        "lighthouse",
        ("--lighthouse",),
        REPLICAS,
        "the lighthouse of a job whose groups run on several machines "
        "(python -m multigpu.launch.replicas --bind HOST:PORT hosts one)",
        metavar="HOST:PORT",
    ),
    Knob(
        "standalone",
        ("--standalone",),
        TORCHRUN,
        "one machine, a free rendezvous port: what multigpu run does on one machine anyway",
        False,
        switch=True,
        handed_on=False,
    ),
    Knob(
        "rdzv_backend",
        ("--rdzv-backend",),
        TORCHRUN,
        "c10d (with --rdzv-endpoint) or static (with --master-addr/"
        "--master-port); chosen from the other flags when not given",
        metavar="c10d|static",
        handed_on=False,
    ),
    Knob(
        "rdzv_conf",
        ("--rdzv-conf",),
        TORCHRUN,
        "join_timeout=S (the same as --rdzv-timeout S)",
        metavar="KEY=VALUE,...",
        handed_on=False,
    ),
    Knob(
        "monitor_interval",
        ("--monitor-interval",),
        TORCHRUN,
        "how often the agent polls the workers, in seconds (default 0.1)",
        type=float,
        metavar="S",
        handed_on=False,
        check=_interval,
    ),
    Knob(
        "start_method",
        ("--start-method",),
        TORCHRUN,
        "only spawn: each worker starts a fresh interpreter",
        metavar="spawn",
        handed_on=False,
    ),
    Knob(
        "role",
        ("--role",),
        TORCHRUN,
        "the worker group's name in torch elastic's logs (default: default)",
        metavar="NAME",
        handed_on=False,
        check=_address("trainer"),
    ),
    Knob(
        "run_path",
        ("--run-path",),
        TORCHRUN,
        "run the script as a file: what multigpu run does anyway",
        False,
        switch=True,
        handed_on=False,
    ),
    Knob(
        "local_addr",
        ("--local-addr",),
        TORCHRUN,
        "this node's address as the other nodes reach it (c10d rendezvous)",
        metavar="HOST",
        check=_address("10.0.0.2"),
    ),
)
BY_NAME: Mapping[str, Knob] = {knob.name: knob for knob in KNOBS}
#: The device and node flags that ``run`` and ``doctor`` share (``doctor`` hands them on to ``run``).
LAUNCH_GROUPS = (DEVICES, NODES)


def add_knobs(
    parser: argparse.ArgumentParser, groups: Sequence[str], defaults: Mapping[str, Any] = {}
) -> None:
    """The knobs of ``groups``, each group a section of ``--help``; ``defaults`` overrides a knob's own
    for this command (``doctor`` waits 60 s for its nodes, not 900)."""
    for title in groups:
        section = parser.add_argument_group(title)
        for knob in KNOBS:
            if knob.group == title:
                knob.add_to(section, defaults.get(knob.name, knob.default))


def check_knobs(args: argparse.Namespace) -> None:
    """Each given value within its knob's bounds (one line naming the flag otherwise)."""
    for knob in KNOBS:
        value = getattr(args, knob.name, None)
        if knob.check is not None and value is not None:
            knob.check(value, knob.flags[0])
