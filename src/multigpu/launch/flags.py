"""One ``multigpu run`` command line, built in one place: :class:`RunFlags` and ``to_argv()``.

Why: the queue, ``check``, ``env --check``, ``doctor``, ``--simulate-nodes`` and Slurm scripts all start
``multigpu run`` as a child process. Each used to assemble its own argv; a flag renamed in the parser
then silently dropped out of one of them. Here every flag has one spelling, values are written only
when they differ from the launcher's default, and the target always comes last behind ``--`` (a
script named like a flag is never read as one) or as ``-m module``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from multigpu.launch.exit_watch import EXIT_TIMEOUT_S
from multigpu.launch.interpreter import python_module

#: (field, flag) for flags with a value, in the order they are written; ``None`` values are left out.
_VALUED = (("nnodes", "--nnodes"), ("node_rank", "--node-rank"), ("master_addr", "--master-addr"),
           ("master_port", "--master-port"), ("rdzv_endpoint", "--rdzv-endpoint"), ("rdzv_id", "--rdzv-id"),
           ("rdzv_timeout", "--rdzv-timeout"), ("nproc", "--nproc"), ("gpus", "--gpus"),
           ("gpus_per_proc", "--gpus-per-proc"), ("procs_per_gpu", "--procs-per-gpu"),
           ("simulate_nodes", "--simulate-nodes"), ("max_restarts", "--max-restarts"),
           ("stop_timeout", "--stop-timeout"), ("exit_timeout", "--exit-timeout"), ("log_dir", "--log-dir"),
           ("tee_prefix", "--tee-prefix"),
           ("local_addr", "--local-addr"), ("replica_groups", "--replica-groups"), ("replica_group", "--replica-group"),
           ("min_replicas", "--min-replicas"), ("lighthouse", "--lighthouse"),
           ("heartbeat_timeout", "--heartbeat-timeout"))
_SWITCHES = (("cpu", "--cpu"), ("debug", "--debug"), ("verbose", "--verbose"), ("profile", "--profile"))
#: The device and node flags that ``run`` and ``doctor`` share (``doctor`` hands them on to ``run``).
LAUNCH_FIELDS = ("gpus", "nproc", "gpus_per_proc", "procs_per_gpu", "cpu", "nnodes", "node_rank", "master_addr",
                 "master_port", "rdzv_endpoint", "rdzv_id", "rdzv_timeout", "simulate_nodes")
#: What the launcher does when a flag is not given: such values are not written.
_DEFAULTS = {"nnodes": "1", "node_rank": 0, "gpus_per_proc": 1, "procs_per_gpu": 1, "max_restarts": 0,
             "min_replicas": 1, "heartbeat_timeout": 5.0, "exit_timeout": EXIT_TIMEOUT_S}


@dataclass(frozen=True)
class RunFlags:
    """The launcher's flags; a field left at None (or the launcher's default) is not written.

    Values are kept as given: a Slurm script passes ``"$SLURM_JOB_NUM_NODES"`` for ``nnodes``, which
    the script's shell expands.
    """

    nproc: Union[int, str, None] = None
    gpus: Optional[str] = None
    gpus_per_proc: Union[int, str, None] = None
    procs_per_gpu: Union[int, str, None] = None
    cpu: bool = False
    nnodes: Union[int, str, None] = None
    node_rank: Union[int, str, None] = None
    master_addr: Optional[str] = None
    master_port: Union[int, str, None] = None
    rdzv_endpoint: Optional[str] = None
    rdzv_id: Optional[str] = None
    rdzv_timeout: Union[int, str, None] = None
    simulate_nodes: Union[int, str, None] = None
    max_restarts: Union[int, str, None] = None
    stop_timeout: Union[int, str, None] = None
    exit_timeout: Union[int, str, None] = None
    log_dir: Optional[str] = None
    tee_prefix: Optional[str] = None
    local_addr: Optional[str] = None
    #: Replica groups (``--replica-groups R``; one group of them: ``--replica-group G --lighthouse HOST:PORT``).
    replica_groups: Union[int, str, None] = None
    replica_group: Union[int, str, None] = None
    min_replicas: Union[int, str, None] = None
    lighthouse: Optional[str] = None
    heartbeat_timeout: Union[float, str, None] = None
    debug: bool = False
    verbose: bool = False
    profile: bool = False

    @classmethod
    def from_launch_args(cls, args: argparse.Namespace) -> "RunFlags":
        """The device and node flags (``commands.launching.add_launch_flags``) of a parsed command line."""
        return cls(**{name: getattr(args, name) for name in LAUNCH_FIELDS})

    def flags(self) -> list[str]:
        """Only the flags, in a fixed order."""
        out: list[str] = []
        for name, flag in _VALUED:
            value = getattr(self, name)
            if value is not None and _DEFAULTS.get(name, object()) != value:
                out += [flag, str(value)]
        out += [flag for name, flag in _SWITCHES if getattr(self, name)]
        return out

    def to_argv(self, target: Sequence[str], python: str = sys.executable) -> list[str]:
        """``python -P -m multigpu run FLAGS -- script args`` (or ``... -m module args``; ``-P``: see
        :mod:`.interpreter`).

        ``target``: ``[script, *args]``, ``["-m", module, *args]`` or ``["--", script, *args]``.
        """
        target = list(target)
        if target and target[0] not in ("-m", "--"):
            target = ["--", *target]
        return [*python_module("multigpu", python), "run", *self.flags(), *target]
