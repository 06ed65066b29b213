"""``multigpu run``: start the workers of one node on PyTorch's elastic agent (what torchrun uses).

Why the elastic agent and not a home-made spawner: it already does rendezvous across nodes, restarts
(``--max-restarts``), signal forwarding and per-rank log files, and it is what users' clusters already
trust. This module adds what torchrun leaves to the user: device selection, a free port on one machine,
a refused taken port, a one-line summary of the first failing rank with the tail of its stderr, and a
worker wrapper that exits cleanly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from multigpu.distributed.job import JOB_VAR, Workers, job_env, parse_job
from multigpu.errors import (
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    EXIT_STUCK_AT_EXIT,
    LaunchError,
    shown,
    visible,
)
from multigpu.fileio import Folder
from multigpu.launch import environment
from multigpu.launch.attempts import clear_records
from multigpu.launch.devices import DevicePlan
from multigpu.launch.exit_watch import EXIT_TIMEOUT_S, Ended, watching_exits
from multigpu.launch.interpreter import python_module
from multigpu.launch.ports import store_ports_held
from multigpu.launch.process import (
    STOP_TIMEOUT_S,
    Handlers,
    Stopped,
    StopSignals,
    agent_signal_handlers,
    collector_paused,
    install_stops,
    is_command_process,
    restore_stops,
    watching_stops,
)
from multigpu.launch.rendezvous import Rendezvous, require_resolvable
from multigpu.launch.reporting import (
    RESTART_NOTE,
    has_logs,
    preempted_cleanly,
    recorded_errors,
    report_failure,
    reporting_restarts,
    say,
)
from multigpu.launch.torch_agent import cheap_method_names

WORKER_MODULE = "multigpu.launch.worker"


@dataclass(frozen=True)
class LaunchRequest:
    command: tuple[str, ...]  # ("train.py", *args) or ("-m", "pkg.mod", *args)
    devices: DevicePlan
    rendezvous: Rendezvous
    max_restarts: int = 0
    log_dir: Optional[str] = None
    monitor_interval: float = 0.1
    #: After forwarding SIGTERM/SIGUSR1, how long workers may take to checkpoint before SIGKILL.
    stop_timeout_s: int = STOP_TIMEOUT_S
    verbose: bool = False
    extra_env: dict[str, Any] = field(default_factory=dict)
    #: "[rankN]: " before each stderr line: "always", "never", or "auto" (not on a terminal, else if N > 1).
    tee_prefix: str = "auto"
    #: ``--debug``: torch's and NCCL's diagnostics on, the flight recorder dumping into the log folder.
    debug: bool = False
    #: torchrun's ``--role`` (the worker group's name in torch elastic's logs) and ``--local-addr``.
    role: str = "default"
    local_addr: Optional[str] = None
    #: ``--profile``: the workers' Trainers trace a few steps (the job's ``profile``).
    profile: bool = False
    #: What the restart line says happens next (replica groups heal from a live group instead).
    restart_note: str = RESTART_NOTE
    #: ``--exit-timeout``: a worker alive this long after every local rank finished its script is ended.
    exit_timeout_s: int = EXIT_TIMEOUT_S


def prepare_log_dir(path: str) -> Path:
    """``--log-dir``: created if missing; a file, or a folder we cannot write, is refused now."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise LaunchError(
            f"--log-dir {path} is a file, not a folder.", "give a folder for the per-rank logs."
        )
    try:
        Folder(folder).create()
    except OSError as exc:
        raise LaunchError(
            f"cannot create --log-dir {path}: {exc.strerror or exc}.",
            "give a folder you can write to.",
        ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LaunchError(f"--log-dir {path} is not writable.", "give a folder you can write to.")
    return folder


def worker_env(
    request: LaunchRequest, log_dir: Optional[str] = None, tee_prefix: bool = False
) -> dict[str, str]:
    """What the children inherit beyond torch's own RANK/WORLD_SIZE/MASTER_* variables: their job (what
    started this launcher asked, and this launcher's word to its own workers) and a few of torch's."""
    workers = Workers(
        agent_pid=os.getpid(),
        devices_per_process=request.devices.gpus_per_proc,
        processes_per_device=request.devices.procs_per_gpu,
        log_dir=log_dir or None,
        # the user's folder keeps both streams (--tee 3)
        keep_stdout=request.log_dir is not None,
        tee_prefix=tee_prefix,
        announce_node=request.rendezvous.backend == "c10d" and request.rendezvous.max_nodes > 1,
    )
    env = job_env(
        os.environ.get(JOB_VAR),
        workers=workers,
        simulated_node=False,  # the launcher-to-launcher words stop here (see Job)
        replica_launcher_pid=0,
        **({"profile": True} if request.profile else {}),
    )
    if request.rendezvous.backend == "c10d":
        # torch 2.13's c10d rendezvous otherwise shares one TCPStore across restarts, un-prefixed: a
        # restarted worker can read the previous attempt's gloo addresses and fail to connect (seen
        # here in 1 of 6 restarts). Unshared, each rendezvous round bootstraps a fresh store, on a port
        # the agent picks and this process holds (ports.store_ports_held).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if request.devices.visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = request.devices.visible
    if "OMP_NUM_THREADS" not in os.environ and request.devices.nproc > 1:
        # torchrun's default of 1 starves CPU training; split the cores this process may use instead
        # (its affinity: a Slurm task sees its allocation, not the whole node).
        env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // request.devices.nproc))
    env.update({k: str(v) for k, v in request.extra_env.items()})
    return env


def debug_env(log_dir: str, nccl: bool, torch_version: str) -> dict[str, str]:
    """What ``multigpu run --debug`` sets, for the hang or mismatch that needs more than our one line.

    On GPUs (NCCL): TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch check that every rank calls the same
    collective with the same shapes (and log each one); NCCL_DEBUG=INFO shows the transport NCCL picked
    (the usual cause of a slow or stuck multi-node job); the flight recorder keeps the last collectives
    of each rank and, on a timeout, dumps them to ``<log dir>/nccl_trace_rank_<R>`` for
    ``python -m torch.distributed.flight_recorder.fr_trace <log dir>`` (its buffer variable is
    ``TORCH_FR_BUFFER_SIZE`` from torch 2.7; the older name is deprecated there).

    On CPU processes (gloo): INFO, not DETAIL - DETAIL with DDP over gloo ends in SIGSEGV (measured with
    torch 2.13 and a plain torchrun script: 4 times in 4), and NCCL's variables do nothing there.
    Values the user already set win.
    """
    wanted = {
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL" if nccl else "INFO",
        "TORCH_SHOW_CPP_STACKTRACES": "1",
    }
    if nccl:
        major, minor = (int(part) for part in re.findall(r"\d+", torch_version)[:2])
        buffer = (
            "TORCH_FR_BUFFER_SIZE" if (major, minor) >= (2, 7) else "TORCH_NCCL_TRACE_BUFFER_SIZE"
        )
        wanted.update(
            {
                "NCCL_DEBUG": "INFO",
                buffer: "2000",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(log_dir) / "nccl_trace_rank_"),
            }
        )
    return {k: os.environ.get(k, v) for k, v in wanted.items()}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def launch(request: LaunchRequest) -> int:
    """Run the workers of this node to completion; return the exit status for the shell."""
    # a value every rank would die of: one line, now
    environment.launch_environment(os.environ, LaunchError)
    if request.rendezvous.endpoint.rpartition(":")[0] not in ("localhost", "127.0.0.1"):
        require_resolvable(
            request.rendezvous.endpoint.rpartition(":")[0],
            "--master-addr" if request.rendezvous.backend == "static" else "--rdzv-endpoint",
        )
    stops, status = StopSignals(), None  # signal handlers: the main thread only
    saved = agent_signal_handlers() if threading.current_thread() is threading.main_thread() else []
    # stop signals raise until torch's agent puts its own handlers in place, and after it they wait
    try:
        install_stops(stops, saved)
        return (status := _launch(request, stops, saved))
    except Stopped as stopped:  # before the start-up's own try
        return _stopped_while_starting(stopped.signum)
    finally:
        restore_stops(stops, saved, deliver=status == 0)


def _stopped_while_starting(number: int, when: str = "while starting") -> int:
    say(f"stopped by {signal.Signals(number).name} {when}; no worker had started.")
    return EXIT_INTERRUPTED if number == signal.SIGINT else 128 + number


def _give_up_waiting(log_dir: str, keep_logs: bool) -> Callable[[int], None]:
    """What a stop does while this node waits inside C++ for the others (``watching_stops``' thread acts:
    the main thread would only see the stop when the rendezvous times out): the launcher's clean-up, its
    line, its status, and out."""

    def give_up(number: int) -> None:
        status = EXIT_INTERRUPTED if number == signal.SIGINT else 128 + number
        try:
            if not keep_logs and not has_logs(log_dir):
                with contextlib.suppress(OSError):
                    Folder(Path(log_dir).parent).remove_tree(Path(log_dir).name)
            status = _stopped_while_starting(number, "while waiting for the other nodes")
        # nothing may keep this process: its main thread waits in C++ up to the rendezvous timeout
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(status)

    return give_up


def import_torch_quietly(verbose: bool) -> None:
    """Import torch in this process with its C++ log level at FATAL, unless ``verbose`` or the user chose a
    level (``TORCH_CPP_LOG_LEVEL``). Why: when a node cannot reach the rendezvous, c10d's TCPStore client logs
    every retry with a C++ stack trace (dozens of lines) before the launcher's one line with a HINT. torch
    reads the variable once, at import; it is gone from the environment again before any worker starts, so
    the workers log at the user's level."""
    quiet = "torch" not in sys.modules and not verbose and "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    # torch's own parser of TORCH_LOGS, at import: every rank would fail the same way
    except ValueError as exc:
        if not os.environ.get("TORCH_LOGS"):
            raise
        raise LaunchError(
            f"TORCH_LOGS={shown(os.environ['TORCH_LOGS'], 60)} is not what torch takes: "
            f"{shown(' '.join(str(exc).split())[:160], 170)}.",
            "name torch's log components (TORCH_LOGS=+dynamo,ddp; `TORCH_LOGS=help python -c 'import "
            "torch'` lists them), or unset it.",
        ) from None
    finally:
        if quiet:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def _launch(request: LaunchRequest, stops: StopSignals, saved: Handlers) -> int:
    keep_logs = request.log_dir is not None or request.debug
    log_dir, failed, when = "", False, "while starting"
    try:  # torch's agent handles signals once it runs; before that they end the start-up cleanly
        with stops.held():  # the folder and our hold on it come together
            log_dir = (
                str(prepare_log_dir(request.log_dir))
                if request.log_dir is not None
                else tempfile.mkdtemp(prefix="multigpu-logs-")
            )
        clear_records(log_dir)  # a reused --log-dir: only this launch's workers speak through it
        prefix = request.tee_prefix == "always" or (
            request.tee_prefix == "auto"
            and request.devices.nproc * request.rendezvous.max_nodes > 1
            and not (sys.stderr and sys.stderr.isatty())
        )
        # read before the workers' environment replaces this process's job (see worker_env)
        simulated = parse_job(os.environ.get(JOB_VAR)).simulated_node
        env = worker_env(request, log_dir, prefix)
        if request.debug:
            from importlib.metadata import version

            nccl = bool(request.devices.visible) and request.devices.procs_per_gpu == 1
            debug = debug_env(log_dir, nccl, version("torch"))
            env.update(debug)
            print(
                "multigpu: debug: "
                + " ".join(f"{k}={v}" for k, v in debug.items())
                + f"; every rank's log is kept in {log_dir}",
                file=sys.stderr,
                flush=True,
            )
        # frozen where the command's own process imports it (a Python process that calls the launcher keeps
        # its heap as it is)
        with collector_paused(freeze=is_command_process() and "torch" not in sys.modules):
            import_torch_quietly(request.verbose)
            from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
            from torch.distributed.elastic.multiprocessing.api import SignalException
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
            from torch.distributed.launcher.api import LaunchConfig, elastic_launch
        before = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # the workers' environment: torch's agent gives them this process's
        # from here a stop raises what torch's own handler would (its agent then leaves the rendezvous open)
        stops.raising = lambda number: SignalException(
            f"got signal {number}", signal.Signals(number)
        )
    except (Stopped, KeyboardInterrupt) as stopped:
        stops.holding = True  # a second stop waits until this one is cleaned up
        if log_dir and not keep_logs:
            with contextlib.suppress(OSError):
                Folder(Path(log_dir).parent).remove_tree(Path(log_dir).name)
        return _stopped_while_starting(
            stopped.signum if isinstance(stopped, Stopped) else int(signal.SIGINT)
        )

    ended: list[Ended] = []
    try:  # from here on the log folder is removed or kept on every way out (Ctrl-C included)
        # we report failures ourselves; torch's elastic loggers each set their own level
        if not request.verbose:
            for name in list(logging.root.manager.loggerDict):
                if name.startswith("torch.distributed.elastic"):
                    logging.getLogger(name).setLevel(logging.CRITICAL)
        rdzv = request.rendezvous
        total = (
            f"{request.devices.nproc * rdzv.max_nodes}"
            if rdzv.min_nodes == rdzv.max_nodes
            else "elastic"
        )
        config = LaunchConfig(
            min_nodes=rdzv.min_nodes,
            max_nodes=rdzv.max_nodes,
            nproc_per_node=request.devices.nproc,
            run_id=rdzv.run_id,
            role=request.role,
            local_addr=request.local_addr,
            rdzv_endpoint=rdzv.endpoint,
            rdzv_backend=rdzv.backend,
            rdzv_configs=rdzv.configs(),
            max_restarts=request.max_restarts,
            monitor_interval=request.monitor_interval,
            start_method="spawn",
            # USR1 too: Slurm's "time is nearly up" warning must reach the workers, not kill the launcher.
            signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            shutdown_timeout=request.stop_timeout_s,
            # Workers write to this terminal directly; each copies its stderr into log_dir itself
            # (worker.py + tee.py), so progress bars keep redrawing in place. torch keeps its error files here.
            logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.NONE, tee=Std.NONE),
        )
        if rdzv.backend == "static" and rdzv.max_nodes > 1:
            where = f"node {rdzv.node_rank} of {rdzv.max_nodes}, "
        # c10d numbers the nodes when they have joined: each worker's node says it then
        elif rdzv.max_nodes > 1:
            where = (
                f"one of {rdzv.min_nodes}-{rdzv.max_nodes} nodes, "
                if rdzv.min_nodes != rdzv.max_nodes
                else f"one of {rdzv.max_nodes} nodes, "
            )
        else:
            where = ""
        threads = (
            f", {env['OMP_NUM_THREADS']} CPU thread(s) each" if "OMP_NUM_THREADS" in env else ""
        )
        say(
            f"{request.devices.describe()}{threads} ({where}world size {total}), rendezvous {rdzv.backend} {rdzv.endpoint}"
        )
        if rdzv.max_nodes > 1:
            last_call = (
                " (then up to 30 s more for late nodes, up to the maximum)"
                if rdzv.min_nodes != rdzv.max_nodes
                else ""
            )
            others = (
                "the other simulated nodes start here too"
                if simulated
                else "start the same command on the other nodes"
            )
            say(
                f"waiting up to {rdzv.timeout_s} s for {rdzv.min_nodes} node(s) to join at {rdzv.endpoint}{last_call}; "
                f"{others}"
            )
        python, *options = python_module(WORKER_MODULE, unbuffered=True)
        first_rank = rdzv.node_rank * request.devices.nproc if rdzv.backend == "static" else 0
        with (
            reporting_restarts(log_dir, first_rank, request.verbose, request.restart_note),
            store_ports_held(),
            cheap_method_names(),
            watching_exits(log_dir, request.devices.nproc, request.exit_timeout_s) as watch,
        ):
            ended = watch.ended
            # waiting for other nodes blocks in C++, where no Python handler runs: a thread acts on a stop then
            # (the command's own process only: a Python program that calls the launcher must not be ended)
            waiting = (
                watching_stops(stops, _give_up_waiting(log_dir, keep_logs))
                if rdzv.max_nodes > 1 and is_command_process()
                else contextlib.nullcontext()
            )
            when = "while waiting for the other nodes" if rdzv.max_nodes > 1 else when
            try:
                with waiting:
                    elastic_launch(config, python)(*options, *request.command)
            # torch's handlers raise and torch leaves them: a stop now waits for our report and clean-up
            finally:
                install_stops(stops, saved, holding=True)
        if ended:
            failed = True
            return report_stuck_at_exit(ended, request.exit_timeout_s, log_dir)
    except ChildFailedError as failure:
        failed = True
        status = report_failure(failure.failures, log_dir)
        if ended:
            report_stuck_at_exit(ended, request.exit_timeout_s, log_dir)
        return status
    except SignalException as stopped:
        if stops.raised:  # ours, before torch's agent took the stop signals: no worker had started
            return _stopped_while_starting(int(stopped.sigval), when)
        # e.g. a script that caught Ctrl-C and then hit a refused collective
        for line in recorded_errors(log_dir):
            print(visible(line), file=sys.stderr, flush=True)
        name = signal.Signals(stopped.sigval).name
        if preempted_cleanly(log_dir):
            say(
                f"stopped by {name}: every worker wrote its checkpoint and left with status {EXIT_PREEMPTED} "
                "(run the same command again to resume)."
            )
            return EXIT_PREEMPTED
        say(f"stopped by {name}; every worker was terminated.")
        return 128 + int(stopped.sigval)
    except KeyboardInterrupt:
        say("interrupted; every worker was terminated.")
        return EXIT_INTERRUPTED
    # rendezvous or agent failures: one line, no traceback; status 1, not 2
    except Exception as exc:
        failed = True
        text = " ".join(str(exc).split()) or type(exc).__name__
        error = LaunchError(
            f"the launcher failed before the workers finished: {text[:400]}",
            "check --master-addr/--master-port or --rdzv-endpoint, and that every node was started "
            "(run with --verbose for torch's own log).",
        )
        print(error.one_line(), file=sys.stderr, flush=True)
        failed = has_logs(log_dir)  # an empty folder is not kept
        if keep_logs or failed:
            say(f"logs of every rank are kept in {log_dir}")
        return 1
    finally:
        install_stops(stops, saved, holding=True)  # (where elastic_launch was never called)
        # this process may launch again (a test, a program of its own)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if not keep_logs and not failed:  # our own temporary folder (mkdtemp): removed as a whole
            with contextlib.suppress(OSError):
                Folder(Path(log_dir).parent).remove_tree(Path(log_dir).name)
    return 0


def report_stuck_at_exit(ended: list[Ended], timeout_s: int, log_dir: str) -> int:
    """The line for each worker :mod:`.exit_watch` ended; :data:`EXIT_STUCK_AT_EXIT`."""
    for one in ended:
        where = visible(one.where())[:200]
        stacks = (
            f"Its threads' Python stacks: {visible(str(one.stacks))}"
            if one.written()
            else "Its stacks could not be written."
        )
        done = (
            "its script's work is done; the stacks show"
            if one.status == 0
            else "its script had failed first (above); the stacks show"
        )
        print(
            LaunchError(
                f"rank {one.rank} (pid {one.pid}) finished its script (status {one.status}) but did not exit: it had "
                f"not moved for {timeout_s} s after every rank had finished{f', stuck at {where}' if where else ''}; it "
                f"was ended. {stacks}",
                f"{done} what its exit waited for (a destructor, an exit handler, a thread). Give --exit-timeout "
                "more seconds if its exit waits that long by design.",
            ).one_line(),
            file=sys.stderr,
            flush=True,
        )
    say(f"logs of every rank are kept in {log_dir}")
    return EXIT_STUCK_AT_EXIT


def split_command(
    script: Optional[str], module: Optional[str], args: Sequence[str]
) -> tuple[str, ...]:
    if (script is None) == (module is None):
        raise LaunchError(
            "give a script or -m MODULE (not both).",
            "write `multigpu run train.py ...` or `multigpu run -m pkg.train ...`.",
        )
    if module is not None:
        return ("-m", module, *args)
    path = Path(script or "")  # None: refused above
    if path.is_dir():
        raise LaunchError(
            f"script {script!r} is a folder.",
            f"run its __main__.py ({script}/__main__.py), or the package as a module with -m.",
        )
    if path.exists() and not path.is_file():
        raise LaunchError(
            f"script {script!r} is not a regular file (a FIFO or a device).",
            "give the script's file.",
        )
    if not path.is_file():
        raise LaunchError(
            f"script {script!r} does not exist.",
            "check the path (it is relative to the current folder).",
        )
    return (str(script), *args)
