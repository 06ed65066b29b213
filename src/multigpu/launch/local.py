"""``multigpu run``: start the workers of one node on PyTorch's elastic agent (what torchrun uses).

Why the elastic agent and not a home-made spawner: it already does rendezvous across nodes, restarts
(``--max-restarts``), signal forwarding and per-rank log files, and it is what users' clusters already
trust. This module adds what torchrun leaves to the user: device selection, a free port on one machine,
a refused taken port, a one-line summary of the first failing rank with the tail of its stderr, and a
worker wrapper that exits cleanly.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from multigpu.errors import LaunchError
from multigpu.launch.devices import DevicePlan
from multigpu.launch.ports import require_free_port
from multigpu.world import DEVICES_PER_PROC_VAR

#: Lets a worker notice that its launcher is gone and exit (no orphans even if the agent is SIGKILLed).
AGENT_PID_VAR = "MULTIGPU_AGENT_PID"
WORKER_MODULE = "multigpu.launch.worker"
STDERR_TAIL_LINES = 20
DEFAULT_RDZV_TIMEOUT_S = 900


@dataclass(frozen=True)
class Rendezvous:
    backend: str  # "c10d" or "static"
    endpoint: str
    run_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    timeout_s: int = DEFAULT_RDZV_TIMEOUT_S

    def configs(self) -> dict:
        if self.backend == "static":
            return {"rank": self.node_rank, "timeout": self.timeout_s}
        return {"join_timeout": self.timeout_s}


@dataclass(frozen=True)
class LaunchRequest:
    command: tuple[str, ...]  # ("train.py", *args) or ("-m", "pkg.mod", *args)
    devices: DevicePlan
    rendezvous: Rendezvous
    max_restarts: int = 0
    log_dir: Optional[str] = None
    monitor_interval: float = 0.1
    #: After forwarding SIGTERM/SIGUSR1, how long workers may take to checkpoint before SIGKILL.
    stop_timeout_s: int = 120
    verbose: bool = False
    extra_env: dict = field(default_factory=dict)


def parse_nnodes(text: str) -> tuple[int, int]:
    lo, sep, hi = str(text).partition(":")
    try:
        min_nodes, max_nodes = int(lo), int(hi if sep else lo)
    except ValueError:
        raise LaunchError(f"--nnodes {text!r} is not a number or MIN:MAX.", "write --nnodes 2 or --nnodes 1:4.") from None
    if not 0 < min_nodes <= max_nodes:
        raise LaunchError(f"--nnodes {text!r}: need 0 < MIN <= MAX.", "write --nnodes 2 or --nnodes 1:4.")
    return min_nodes, max_nodes


def plan_rendezvous(
    nnodes: str = "1",
    node_rank: int = 0,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    rdzv_endpoint: Optional[str] = None,
    rdzv_id: Optional[str] = None,
    timeout_s: int = DEFAULT_RDZV_TIMEOUT_S,
) -> Rendezvous:
    """Static rendezvous for ``--master-addr/--master-port`` (the seeds' recipe), c10d otherwise."""
    min_nodes, max_nodes = parse_nnodes(nnodes)
    if rdzv_endpoint:
        if master_port is not None or master_addr is not None:
            raise LaunchError(
                "--rdzv-endpoint and --master-addr/--master-port both name the rendezvous.", "give only one of them."
            )
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise LaunchError(f"--rdzv-endpoint {rdzv_endpoint!r} is not HOST:PORT.", "write --rdzv-endpoint node1:29400.")
        return Rendezvous("c10d", rdzv_endpoint, rdzv_id or "multigpu", min_nodes, max_nodes, 0, timeout_s)
    if min_nodes != max_nodes:
        raise LaunchError(
            f"--nnodes {nnodes} is elastic, which needs a c10d rendezvous.",
            "add --rdzv-endpoint HOST:PORT (the first node's address) instead of --master-addr/--master-port.",
        )
    if not 0 <= node_rank < max_nodes:
        raise LaunchError(
            f"--node-rank {node_rank} is outside 0..{max_nodes - 1} for --nnodes {max_nodes}.",
            "number the machines 0, 1, ... and give node 0's address as --master-addr.",
        )
    if max_nodes == 1 and master_port is None:
        # One machine: let the agent's store bind port 0, so concurrent launches never clash.
        return Rendezvous("c10d", "localhost:0", rdzv_id or uuid.uuid4().hex[:12], 1, 1, 0, timeout_s)
    if max_nodes > 1 and (master_addr is None or master_port is None):
        missing = "--master-addr" if master_addr is None else "--master-port"
        raise LaunchError(
            f"--nnodes {max_nodes} needs {missing}.",
            "give every node the same --master-addr (node 0's address) and --master-port, "
            "or use --rdzv-endpoint HOST:PORT.",
        )
    addr = master_addr or "127.0.0.1"
    if node_rank == 0:
        require_free_port(int(master_port))  # node 0 hosts the store: refuse a taken port now
    return Rendezvous("static", f"{addr}:{master_port}", rdzv_id or "multigpu", max_nodes, max_nodes, node_rank, timeout_s)


def worker_env(request: LaunchRequest) -> dict[str, str]:
    """What the children inherit beyond torch's own RANK/WORLD_SIZE/MASTER_* variables."""
    env = {AGENT_PID_VAR: str(os.getpid()), DEVICES_PER_PROC_VAR: str(request.devices.gpus_per_proc)}
    if request.rendezvous.backend == "c10d":
        # torch 2.13's c10d rendezvous otherwise shares one TCPStore across restarts, un-prefixed: a
        # restarted worker can read the previous attempt's gloo addresses and fail to connect (seen
        # here in 1 of 6 restarts). Unshared, each rendezvous round bootstraps a fresh store.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if request.devices.visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = request.devices.visible
    if "OMP_NUM_THREADS" not in os.environ and request.devices.nproc > 1:
        # torchrun's default of 1 starves CPU training; split the cores this process may use instead
        # (its affinity: a Slurm task sees its allocation, not the whole node).
        env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // request.devices.nproc))
    env.update({k: str(v) for k, v in request.extra_env.items()})
    return env


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def launch(request: LaunchRequest) -> int:
    """Run the workers of this node to completion; return the exit status for the shell."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not request.verbose:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # we report failures ourselves
    os.environ.update(worker_env(request))
    keep_logs = request.log_dir is not None
    log_dir = request.log_dir or tempfile.mkdtemp(prefix="multigpu-logs-")
    rdzv = request.rendezvous
    total = f"{request.devices.nproc * rdzv.max_nodes}" if rdzv.min_nodes == rdzv.max_nodes else "elastic"
    config = LaunchConfig(
        min_nodes=rdzv.min_nodes,
        max_nodes=rdzv.max_nodes,
        nproc_per_node=request.devices.nproc,
        run_id=rdzv.run_id,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_backend=rdzv.backend,
        rdzv_configs=rdzv.configs(),
        max_restarts=request.max_restarts,
        monitor_interval=request.monitor_interval,
        start_method="spawn",
        # USR1 too: Slurm's "time is nearly up" warning must reach the workers, not kill the launcher.
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        shutdown_timeout=request.stop_timeout_s,
        # Several workers: stderr goes to a file per rank and on to the console with a [rankN] prefix,
        # for the failure summary. One worker writes straight to the console, unprefixed.
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.NONE, tee=Std.ERR if total != "1" else Std.NONE),
        log_line_prefix_template="[rank${rank}]: " if total != "1" else None,
    )
    where = f"node {rdzv.node_rank} of {rdzv.max_nodes}, " if rdzv.max_nodes > 1 else ""
    _say(f"{request.devices.describe()} ({where}world size {total}), rendezvous {rdzv.backend} {rdzv.endpoint}")
    command = ("-u", "-m", WORKER_MODULE, *request.command)
    try:
        elastic_launch(config, sys.executable)(*command)
    except ChildFailedError as failed:
        rank, failure = root_cause(failed.failures)
        _report_failure(rank, failure, len(failed.failures) - 1, log_dir)
        return _exit_status(failure.exitcode)
    except SignalException as stopped:
        _say(f"stopped by {signal.Signals(stopped.sigval).name}; every worker was terminated.")
        return 128 + int(stopped.sigval)
    except KeyboardInterrupt:
        _say("interrupted; every worker was terminated.")
        return 130
    except Exception as exc:  # rendezvous or agent failures: one line, no traceback; status 1, not 2
        text = " ".join(str(exc).split()) or type(exc).__name__
        error = LaunchError(
            f"the launcher failed before the workers finished: {text[:400]}",
            "check --master-addr/--master-port or --rdzv-endpoint, and that every node was started "
            "(run with --verbose for torch's own log).",
        )
        print(error.one_line(), file=sys.stderr, flush=True)
        return 1
    if not keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _exit_status(exitcode: int) -> int:
    return 128 - exitcode if exitcode < 0 else (exitcode or 1)


#: Messages of ranks that failed only because a peer went away first.
_PEER_GONE = ("connection reset by peer", "connection closed by peer", "broken pipe", "dist backend error",
              "distbackenderror", "nccl communicator was aborted", "socket timeout", "connection refused",
              "ranks disagree before training")
_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP), int(signal.SIGUSR1)}


def root_cause(failures: dict) -> tuple[int, Any]:
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
            priority = 3 if any(p in message for p in _PEER_GONE) else 1
        return (priority, failure.timestamp, rank)

    return min(failures.items(), key=key)


def _report_failure(rank: int, failure: Any, others: int, log_dir: str) -> None:
    how = (
        f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    )
    also = f"; {others} other rank(s) failed after it" if others else ""
    _say(f"error: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}{also}.")
    stderr_log = _stderr_log(log_dir, failure.local_rank)
    tail = _tail(stderr_log, STDERR_TAIL_LINES) if stderr_log else []
    if tail:
        _say(f"last lines of rank {rank}'s stderr ({stderr_log}):")
        for line in tail:
            print(f"    {line}", file=sys.stderr)
    if stderr_log is not None:
        _say(f"logs of every rank are kept in {log_dir}")


def _stderr_log(log_dir: str, local_rank: int) -> Optional[Path]:
    """torch keeps ``<log_dir>/<run>/attempt_<n>/<local_rank>/stderr.log``; the newest attempt failed."""
    logs = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def _say(message: str) -> None:
    print(f"multigpu: {message}", file=sys.stderr, flush=True)


def split_command(script: Optional[str], module: Optional[str], args: Sequence[str]) -> tuple[str, ...]:
    if (script is None) == (module is None):
        raise LaunchError("give a script or -m MODULE (not both).", "write `multigpu run train.py ...` or `multigpu run -m pkg.train ...`.")
    if module is not None:
        return ("-m", module, *args)
    if not Path(script).is_file():
        raise LaunchError(f"script {script!r} does not exist.", "check the path (it is relative to the current folder).")
    return (script, *args)
