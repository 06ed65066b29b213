"""The ``multigpu`` command: a thin layer that parses flags and calls launch, queue and diagnostics.

Nothing imports this module. Every :class:`MultiGPUError` - and every flag argparse refuses, and every
file the system refuses to open - becomes one line on stderr with a HINT and exit status 2 (bad input,
nothing was started); a failed run returns the failing worker's status. Commands import what they use
when they run, so ``multigpu slurm status`` or a mistyped flag answers without loading torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from multigpu import validate
from multigpu.errors import ConfigError, LaunchError, MultiGPUError

RUN_EXAMPLES = """\
examples:
  multigpu run train.py hparams.yaml            every visible GPU, one process each (no GPU: 1 CPU process)
  multigpu run --gpus 0,2,3 train.py            the GPUs you name (indexes as nvidia-smi lists them)
  multigpu run --nproc 4 train.py               4 processes (CPU: gloo; GPU: the first 4 GPUs)
  multigpu run --gpus-per-proc 2 train.py       each process owns 2 GPUs (pipeline / ddp+pipeline)
  multigpu run -m mypkg.train --lr 3e-4         run a module, like python -m
  multigpu run --max-restarts 3 train.py        restart every worker (resuming) when one fails

  two machines, 2 GPUs each (run one line on each machine):
  multigpu run --nnodes 2 --node-rank 0 --master-addr host1 --master-port 29500 train.py
  multigpu run --nnodes 2 --node-rank 1 --master-addr host1 --master-port 29500 train.py

  elastic, 1 to 4 machines joining at host1:29400 (the same line on every machine):
  multigpu run --nnodes 1:4 --rdzv-endpoint host1:29400 train.py

  rehearse a 2-node job (2 processes each) on this machine before using the cluster:
  multigpu run --simulate-nodes 2 --nproc 2 train.py

Inside the script, `run = mg.init()` finds all of this; the same script also runs under torchrun
and srun unchanged. Batch sizes are per process: the global batch is batch x processes.
"""

SLURM_EXAMPLES = """\
examples:
  multigpu slurm --nodes 2 --gpus-per-node 4 --time 20:00:00 train.py hparams.yaml
  multigpu slurm --nodes 1 --gpus-per-node 8 --partition gpu --account proj train.py
  multigpu slurm --dry-run --nodes 2 --gpus-per-node 4 train.py     write and show the script only
  multigpu slurm status 12345          state, exit code, restarts, log path
  multigpu slurm logs 12345            the end of the job's log
  multigpu slurm cancel 12345

The script lands in the run folder (--run-dir) with the job's log; it runs one `multigpu run` per node
with a c10d rendezvous on the first node. --signal=USR1@90 and --requeue let the Trainer checkpoint
before the time limit and continue in the requeued job.
"""

QUEUE_EXAMPLES = """\
examples:
  multigpu queue runs.yaml                      every run, one per free GPU (CPU: one per core)
  multigpu queue runs.yaml --gpus 0,1,2,3       on these GPUs only
  multigpu queue runs.yaml --only net,larger_net --max-parallel 2
  multigpu queue runs.yaml --gpus-per-run 2     every run gets 2 GPUs (DDP inside the run)
  multigpu queue runs.yaml --runs-per-gpu 4     4 small runs share each GPU (or gpus: 0.25 per run)
  multigpu queue runs.yaml --slurm --partition gpu --time 4:00:00   one Slurm job per run

runs.yaml: keys are run names; `larger_net < net` inherits every setting of net and overrides some.
  net:
    script: examples/digits/train.py
    args: [examples/digits/hparams.yaml]
    gpus: 1
    overrides: {model.hidden: 128}
  larger_net < net:
    overrides: {model.hidden: 512}
Each run writes into OUT/<run name>/ (run.yaml, log.txt, status.json and the recipe's outputs).
Running the queue again skips finished runs and resumes interrupted ones.
"""

SLURM_ACTIONS = ("submit", "status", "logs", "cancel")


class Parser(argparse.ArgumentParser):
    """argparse, but a refused flag is our one line with a HINT (argparse prints usage and a second line)."""

    def error(self, message: str) -> NoReturn:
        print(f"multigpu: error: {self.prog}: {' '.join(message.split())}. HINT: see `{self.prog} --help`.",
              file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------------------- run


def _add_launch_flags(p: argparse.ArgumentParser, rdzv_timeout: int = 900) -> None:
    """Devices and nodes: the flags `multigpu run` and `multigpu doctor` share."""
    dev = p.add_argument_group("devices and processes")
    dev.add_argument("--gpus", metavar="IDS", help="GPUs to use, e.g. 0,2,3 or 0-3 (default: every visible GPU)")
    dev.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, metavar="N",
                     help="processes on this machine (default: one per GPU, or 1 on a CPU machine)")
    dev.add_argument("--gpus-per-proc", type=int, default=1, metavar="K",
                     help="GPUs owned by each process, for model-parallel strategies (default 1)")
    dev.add_argument("--procs-per-gpu", type=int, default=1, metavar="K",
                     help="processes sharing each GPU, talking over gloo (NCCL refuses two ranks on one GPU); "
                     "for small models and for testing the multi-process path on one GPU (default 1)")
    dev.add_argument("--cpu", action="store_true", help="use CPU processes even where GPUs are visible")
    nodes = p.add_argument_group("several machines")
    nodes.add_argument("--nnodes", default="1", metavar="N|MIN:MAX", help="number of machines (default 1)")
    nodes.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0, metavar="R",
                       help="this machine's index, 0..nnodes-1 (static rendezvous)")
    nodes.add_argument("--master-addr", "--master_addr", dest="master_addr", metavar="HOST",
                       help="address of node 0, reachable from every node")
    nodes.add_argument("--master-port", "--master_port", dest="master_port", type=int, metavar="PORT",
                       help="port on node 0 (default on one machine: a free port is chosen)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="c10d rendezvous (elastic --nnodes MIN:MAX)")
    nodes.add_argument("--rdzv-id", metavar="ID", help="job id shared by every node of a c10d rendezvous")
    nodes.add_argument("--rdzv-timeout", type=int, default=rdzv_timeout, metavar="S",
                       help=f"seconds to wait for every node to join (default {rdzv_timeout})")
    nodes.add_argument("--simulate-nodes", type=int, metavar="N",
                       help="rehearse an N-node job on this machine: N agents on loopback (GPUs split evenly)")


#: The flags `multigpu doctor` hands on to `multigpu run` unchanged (dest, flag, takes a value).
LAUNCH_FLAGS = (("gpus", "--gpus", True), ("nproc", "--nproc", True), ("gpus_per_proc", "--gpus-per-proc", True),
                ("procs_per_gpu", "--procs-per-gpu", True),
                ("cpu", "--cpu", False), ("nnodes", "--nnodes", True), ("node_rank", "--node-rank", True),
                ("master_addr", "--master-addr", True), ("master_port", "--master-port", True),
                ("rdzv_endpoint", "--rdzv-endpoint", True), ("rdzv_id", "--rdzv-id", True),
                ("rdzv_timeout", "--rdzv-timeout", True), ("simulate_nodes", "--simulate-nodes", True))


def launch_flags_of(args: argparse.Namespace) -> list[str]:
    flags: list[str] = []
    for dest, flag, takes_value in LAUNCH_FLAGS:
        value = getattr(args, dest)
        if takes_value and value is not None:
            flags += [flag, str(value)]
        elif not takes_value and value:
            flags.append(flag)
    return flags


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script on every GPU (or N processes) of this machine, or as one node of several",
        description="Start one process per GPU (or --nproc CPU processes) on PyTorch's elastic agent.",
        epilog=RUN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_launch_flags(p)
    misc = p.add_argument_group("failures and logs")
    misc.add_argument("--max-restarts", type=int, default=0, metavar="K",
                      help="restart all workers up to K times when one fails (default 0)")
    misc.add_argument("--stop-timeout", type=int, default=120, metavar="S",
                      help="on SIGTERM/SIGUSR1, seconds the workers get to checkpoint before SIGKILL (default 120)")
    misc.add_argument("--log-dir", metavar="DIR", help="keep each rank's stdout/stderr here (default: a temporary "
                      "folder, removed after a successful run)")
    misc.add_argument("--tee-prefix", choices=("auto", "always", "never"), default="auto",
                      help="put [rankN] before each line of the workers' stderr: auto (not on a terminal, where "
                      "progress bars redraw in place; yes in log files with several ranks), always or never")
    misc.add_argument("--verbose", action="store_true", help="show torch elastic's own log lines (and the launcher's C++ logs)")
    misc.add_argument("--debug", action="store_true",
                      help="TORCH_DISTRIBUTED_DEBUG=DETAIL, NCCL_DEBUG=INFO and the NCCL flight recorder (dumped "
                      "into the log folder on a timeout); keeps every rank's log")
    p.add_argument("-m", "--module", action="store_true", help="the target is a module, run as with python -m")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(handler=_cmd_run)


def _check_run_flags(args: argparse.Namespace) -> None:
    validate.count(args.max_restarts, "--max-restarts", LaunchError, low=0, high=1000)
    validate.positive_seconds(args.stop_timeout, "--stop-timeout", LaunchError)
    validate.positive_seconds(args.rdzv_timeout, "--rdzv-timeout", LaunchError)
    validate.count(args.node_rank, "--node-rank", LaunchError, low=0, high=validate.MAX_NODES)
    if args.master_port is not None:
        validate.count(args.master_port, "--master-port", LaunchError, low=1, high=65535,
                       hint="use a port from 1024 to 65535.")
    if args.log_dir is not None:
        from multigpu.launch.local import prepare_log_dir

        prepare_log_dir(args.log_dir)


def _quiet_agent_logs() -> None:
    """The launcher's own process (not the workers) loads torch with its C++ log level at FATAL.

    Why: when a node cannot reach the rendezvous, c10d's TCPStore client logs every retry with a C++
    stack trace (dozens of lines) before the launcher prints its one line with a HINT. The level is read
    once, when torch loads, so it is set just for that import and removed again: the workers inherit
    the user's environment unchanged. ``--verbose`` or a TORCH_CPP_LOG_LEVEL of your own keeps them."""
    import os

    if "TORCH_CPP_LOG_LEVEL" in os.environ or "torch" in sys.modules:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.verbose:
        _quiet_agent_logs()
    from multigpu.launch.devices import plan_devices, visible_gpus
    from multigpu.launch.local import LaunchRequest, launch, plan_rendezvous, split_command

    _check_run_flags(args)
    command = split_command(None if args.module else args.script, args.script if args.module else None,
                            args.script_args)
    if args.simulate_nodes is not None:
        from multigpu.launch.simulate import simulate

        return simulate(args.simulate_nodes, command, visible=[] if args.cpu else visible_gpus(), gpus=args.gpus,
                        nproc=args.nproc, gpus_per_proc=args.gpus_per_proc, cpu=args.cpu,
                        procs_per_gpu=args.procs_per_gpu,
                        max_restarts=args.max_restarts, stop_timeout=args.stop_timeout,
                        rdzv_timeout=args.rdzv_timeout, verbose=args.verbose, debug=args.debug,
                        clashing={"--nnodes": args.nnodes != "1", "--node-rank": args.node_rank,
                                  "--master-addr": args.master_addr, "--master-port": args.master_port,
                                  "--rdzv-endpoint": args.rdzv_endpoint, "--log-dir": args.log_dir})
    devices = plan_devices([] if args.cpu else visible_gpus(), gpus=args.gpus, nproc=args.nproc,
                           gpus_per_proc=args.gpus_per_proc, cpu=args.cpu, procs_per_gpu=args.procs_per_gpu)
    rendezvous = plan_rendezvous(
        nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
        master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        timeout_s=args.rdzv_timeout,
    )
    request = LaunchRequest(
        command=command, devices=devices, rendezvous=rendezvous, max_restarts=args.max_restarts,
        log_dir=args.log_dir, verbose=args.verbose, stop_timeout_s=args.stop_timeout, tee_prefix=args.tee_prefix,
        debug=args.debug,
    )
    return launch(request)


# --------------------------------------------------------------------------------------- slurm


def add_slurm_job_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Slurm job")
    g.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    g.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs per node (0: CPU nodes)")
    g.add_argument("--nproc-per-node", type=int, metavar="P", help="processes per node (default: one per GPU)")
    g.add_argument("--time", metavar="T", help="time limit, e.g. 20:00:00")
    g.add_argument("--partition", metavar="P")
    g.add_argument("--account", metavar="A")
    g.add_argument("--cpus-per-task", type=int, metavar="C", help="CPU cores for each node's task")
    g.add_argument("--mem", metavar="M", help="memory per node, e.g. 64G")
    g.add_argument("--job-name", metavar="NAME")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="another #SBATCH option, e.g. --sbatch-arg=--qos=high (repeatable)")
    g.add_argument("--dry-run", action="store_true", help="write the script(s), print, do not submit")


def slurm_options_from_args(args: argparse.Namespace):
    from multigpu.launch.slurm import SlurmOptions

    return SlurmOptions(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        nproc_per_node=args.nproc_per_node, time=args.time, partition=args.partition, account=args.account,
        cpus_per_task=args.cpus_per_task, mem=args.mem, job_name=args.job_name,
        max_restarts=getattr(args, "max_restarts", 0) or 0, extra=tuple(args.sbatch_arg),
    )


def _add_slurm_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slurm", help="submit a training script as a Slurm job; status|logs|cancel JOBID",
                       description="Write a readable sbatch script into the run folder and submit it. "
                       "`multigpu slurm train.py ...` is short for `multigpu slurm submit train.py ...`.",
                       epilog=SLURM_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    submit = actions.add_parser("submit", help="write the sbatch script and submit it (the default action)",
                                epilog=SLURM_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_slurm_job_options(submit)
    submit.add_argument("--run-dir", metavar="DIR",
                        help="folder for the script and log (default: outputs/slurm/<name>-<time>)")
    submit.add_argument("--max-restarts", type=int, default=0, metavar="K", help="restarts of the workers inside the job")
    submit.add_argument("-m", "--module", action="store_true", help="the target is a module, run as with python -m")
    submit.add_argument("script", help="training script (or module with -m)")
    submit.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    submit.set_defaults(handler=_cmd_slurm_submit)
    for name, text in (("status", "state, exit code, restarts, nodes and log path of a job"),
                       ("logs", "the end of a job's log"), ("cancel", "cancel a job")):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument("job_id", help="the Slurm job id")
        if name == "logs":
            action.add_argument("--lines", type=int, default=50, metavar="N", help="how many lines (default 50)")
        action.set_defaults(handler=_cmd_slurm_job)


def _cmd_slurm_submit(args: argparse.Namespace) -> int:
    import dataclasses
    import time
    from pathlib import Path

    from multigpu.launch import slurm
    from multigpu.launch.local import split_command

    command = split_command(None if args.module else args.script, args.script if args.module else None,
                            args.script_args)
    options = slurm_options_from_args(args)
    if options.gpus_per_node is None:
        options = dataclasses.replace(options, gpus_per_node=0)
    options.validate()
    name = options.job_name or Path(args.script).stem
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in name).lstrip(".-") or "job"
    run_dir = Path(args.run_dir or Path("outputs") / "slurm" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    job = slurm.SlurmJob(command=command, run_dir=run_dir, options=options)
    if args.dry_run:
        path = slurm.write(job)
        print(path.read_text())
        print(f"# written to {path}; submit with: sbatch {path}")
        return 0
    job_id = slurm.submit(job)
    print(f"submitted job {job_id}")
    print(f"  script: {job.script_path}")
    print(f"  log:    {str(job.log_pattern).replace('%j', job_id)}")
    print(f"  follow: multigpu slurm status {job_id} | multigpu slurm logs {job_id}")
    return 0


def _cmd_slurm_job(args: argparse.Namespace) -> int:
    from multigpu.launch import slurm

    job_id = slurm.check_job_id(args.job_id)
    if args.action == "status":
        print(slurm.status(job_id))
    elif args.action == "cancel":
        slurm.cancel(job_id)
        print(f"cancelled job {job_id}")
    else:
        lines = validate.count(args.lines, "--lines", LaunchError, high=100_000)
        path, tail, total = slurm.log_tail(job_id, lines)
        print(f"==> {path} (last {len(tail)} of {total} lines)")
        print("\n".join(tail))
    return 0


# --------------------------------------------------------------------------------------- queue


def _add_queue_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("queue", help="train many runs at once on a pool of GPUs (or as Slurm jobs)",
                       description="Place each run of a runs file on free GPUs (CPU: process slots).",
                       epilog=QUEUE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs_file")
    p.add_argument("--gpus", metavar="IDS", help="the GPU pool, e.g. 0,1,2,3 (default: every visible GPU)")
    p.add_argument("--slots", type=int, metavar="N", help="N CPU process slots instead of GPUs (default on a "
                   "machine without GPUs: one per core)")
    p.add_argument("--gpus-per-run", type=int, metavar="K", help="override every run's gpus: setting")
    p.add_argument("--runs-per-gpu", type=int, default=1, metavar="K",
                   help="pack K one-GPU runs onto each GPU (CPU: each slot), each held to 1/K of the GPU's "
                   "memory so a run that does not fit fails alone (default 1)")
    p.add_argument("--only", metavar="NAMES", help="comma-separated run names to run (in that order)")
    p.add_argument("--max-parallel", type=int, metavar="M", help="at most M runs at once")
    p.add_argument("--out", metavar="DIR", help="where run folders go (default: outputs/<runs file name>)")
    p.add_argument("--no-live", action="store_true", help="print one line per event instead of a live table")
    p.add_argument("--allow-env", action="append", default=[], metavar="NAME",
                   help="let the runs file set this environment variable (beyond NCCL_*, OMP_*, HF_*, ...; repeatable)")
    p.add_argument("--slurm", action="store_true", help="submit each run as its own Slurm job instead")
    add_slurm_job_options(p)
    p.set_defaults(handler=_cmd_queue)


def _cmd_queue(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multigpu.queue.runs import load_runs

    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else None
    allowed = [validate.env_name(n, ConfigError, "--allow-env: ") for a in args.allow_env for n in a.split(",") if n]
    specs = load_runs(args.runs_file, only, allow_env=allowed)
    if args.gpus_per_run is not None:
        validate.count(args.gpus_per_run, "--gpus-per-run", ConfigError)
        for spec in specs:
            spec.gpus = args.gpus_per_run
    if args.max_parallel is not None:
        validate.count(args.max_parallel, "--max-parallel", ConfigError)
    out = Path(args.out or Path("outputs") / Path(args.runs_file).stem)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder.", "give a folder for the run folders.")
    validate.count(args.runs_per_gpu, "--runs-per-gpu", ConfigError, high=validate.MAX_SHARERS_PER_GPU)
    if args.slurm:
        from multigpu.queue.slurm_jobs import submit_runs

        packed = next((spec.name for spec in specs if spec.gpus < 1), None)
        if args.runs_per_gpu != 1 or packed:
            what = f"--runs-per-gpu {args.runs_per_gpu}" if args.runs_per_gpu != 1 else f"run {packed!r}'s gpus: below 1"
            raise ConfigError(f"{what} packs runs onto shared GPUs, which Slurm jobs do not do (each gets whole GPUs).",
                              "give the runs whole GPUs with --slurm, or pack them inside one job: "
                              "`multigpu queue runs.yaml --runs-per-gpu K` in an sbatch script.")
        options = slurm_options_from_args(args)
        return submit_runs(specs, out, options, dry_run=args.dry_run)
    from rich.console import Console

    from multigpu.launch.devices import visible_gpus
    from multigpu.queue.display import Display
    from multigpu.queue.pool import plan_pool
    from multigpu.queue.scheduler import Queue

    pool = plan_pool(visible_gpus(), gpus=args.gpus, slots=args.slots)
    display = Display(Console(), live=False if args.no_live else None)
    queue = Queue(specs, out, pool.slots, pool.on_gpus, args.max_parallel, display, runs_per_gpu=args.runs_per_gpu)
    code = queue.execute()
    display.summary(queue)
    return code


# ---------------------------------------------------------------------------------- checkpoint


def _add_checkpoint_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="list, verify or consolidate checkpoints",
                       description="Inspect checkpoint folders written by multigpu (replicated or sharded).")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    listing = actions.add_parser("list", help="the checkpoints in a folder, newest first, with their state")
    listing.add_argument("directory")
    verify = actions.add_parser("verify", help="check every file of a checkpoint against its manifest")
    verify.add_argument("path")
    consolidate = actions.add_parser("consolidate", help="one plain state.pt from a sharded (fsdp) checkpoint")
    consolidate.add_argument("path", help="a sharded checkpoint folder (step-N) or a folder of them (the newest)")
    consolidate.add_argument("--out", help="folder for the consolidated checkpoint (default: <parent>/consolidated)")
    p.set_defaults(handler=_cmd_checkpoint)


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multigpu import checkpoint
    from multigpu.checkpoint import sharded
    from multigpu.errors import CheckpointError

    if args.action == "list":
        if not Path(args.directory).is_dir():
            raise CheckpointError(f"{args.directory} is not a folder.", "give the folder holding step-N checkpoints.")
        found = checkpoint.list_checkpoints(args.directory)
        if not found:
            print(f"no checkpoints in {args.directory}")
            return 1
        for info in found:
            try:
                manifest = checkpoint.verify(info.path)
                kind = "sharded" if manifest.get("sharded") else "replicated"
                print(f"{info.path}  step {info.step}  epoch {manifest.get('epoch', '?')}  "
                      f"{kind}, world size {manifest.get('world_size', '?')}  ok")
            except CheckpointError as exc:
                print(f"{info.path}  step {info.step}  CORRUPT: {exc.message}")
        return 0
    if args.action == "verify":
        manifest = checkpoint.verify(args.path)
        print(f"{args.path}: ok ({len(manifest['files'])} file(s) match the manifest)")
        return 0
    path = Path(args.path)
    if not (path / checkpoint.files.MANIFEST).exists():
        info = checkpoint.latest(path)
        if info is None:
            raise CheckpointError(f"no checkpoint at {path}.", "give a step-N folder or the folder holding them.")
        path = info.path
    out = sharded.consolidate(path, Path(args.out) if args.out else None)
    print(f"consolidated {path} -> {out / 'state.pt'} (load with torch.load(..., weights_only=True)['model'])")
    return 0


# ------------------------------------------------------------------------------------------ env


def _cmd_env(args: argparse.Namespace) -> int:
    from multigpu.diagnostics import environment

    if args.nproc is not None:
        validate.count(args.nproc, "--nproc", LaunchError, high=validate.MAX_PROCS_PER_NODE)
    print(environment.report(), flush=True)
    if not args.check:
        return 0
    ok, lines = environment.check(args.nproc, args.gpus, args.cpu)
    print("\n".join(lines))
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------- check


def _add_check_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="prove your script computes on N processes what it computes on one",
                       description="Run the script for K optimizer steps on N processes and on 1 process with N "
                       "times the batch, compare every step's loss and the weights, and say why they differ.",
                       epilog="examples:\n  multigpu check --nproc 2 --steps 5 train.py hparams.yaml\n"
                       "  multigpu check --nproc 4 -m mypkg.train --lr 3e-4\n\nExit 0: equal within a tolerance "
                       "scaled to the dtype; 1: different (with the causes found); 2: the script did not run.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, metavar="N", help="processes to compare with one (default 2)")
    p.add_argument("--steps", type=int, default=5, metavar="K", help="optimizer steps in each run (default 5)")
    p.add_argument("--cpu", action="store_true", help="CPU processes even where GPUs are visible")
    p.add_argument("--tolerance", type=float, metavar="T", help="relative tolerance (default: from the dtype)")
    p.add_argument("--keep", action="store_true", help="keep the per-step records")
    p.add_argument("--timeout", type=int, default=600, metavar="S", help="seconds each run may take (default 600)")
    p.add_argument("-m", "--module", action="store_true", help="the target is a module, run as with python -m")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(handler=_cmd_check)


def _cmd_check(args: argparse.Namespace) -> int:
    from multigpu.diagnostics.check import check
    from multigpu.launch.local import split_command

    validate.positive_seconds(args.timeout, "--timeout", LaunchError)
    if args.tolerance is not None and not (0 < args.tolerance < 1e3):
        raise LaunchError(f"--tolerance {args.tolerance} is not a positive number.", "e.g. --tolerance 1e-4.")
    command = split_command(None if args.module else args.script, args.script if args.module else None,
                            args.script_args)
    return check(list(command), args.nproc, args.steps, cpu=args.cpu, tolerance=args.tolerance, keep=args.keep,
                 timeout_s=args.timeout, out=lambda line: print(line, flush=True))


# --------------------------------------------------------------------------------------- doctor

DOCTOR_EXAMPLES = """\
examples:
  multigpu doctor --out /shared/runs/exp1 --checkpoint-gb 200        this machine, every GPU
  multigpu doctor --nnodes 2 --node-rank 0 --master-addr host1 --master-port 29500 --out /shared/x   (and rank 1 on host2)
  multigpu slurm --nodes 4 --gpus-per-node 8 --time 5:00 -m multigpu.diagnostics.doctor --out /shared/x   (Slurm: a job)

Checks, from inside the same launch a job uses: every node joins the rendezvous; the same multigpu,
torch, CUDA, NCCL and Python everywhere; clocks within --max-clock-skew; --out writable and shared
(a file rank 0 writes is read by every rank); free disk for --checkpoint-gb; GPUs free; all-reduces
of 1 and 256 MiB correct, with their bus bandwidth. The first fault is one line with a HINT; exit 1.
"""


def _add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="pre-flight of the nodes a job will use: versions, clocks, shared folder, "
                       "disk, GPUs, all-reduce bandwidth", description="Check the machines before a long job.",
                       epilog=DOCTOR_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_launch_flags(p, rdzv_timeout=60)
    g = p.add_argument_group("checks")
    g.add_argument("--out", default=".", metavar="DIR", help="the job's output folder (default: here)")
    g.add_argument("--checkpoint-gb", type=float, default=0.0, metavar="G", help="free disk the checkpoints need")
    g.add_argument("--sizes", default="1,256", metavar="MIB,...", help="all-reduce sizes in MiB (default 1,256)")
    g.add_argument("--max-clock-skew", type=float, default=2.0, metavar="S", help="allowed clock spread (default 2 s)")
    g.add_argument("--expect-gbps", type=float, default=0.0, metavar="G",
                   help="fault when the largest all-reduce's bus bandwidth is below this")
    g.add_argument("--timeout", type=int, default=300, metavar="S", help="give up after this long (default 300 s)")
    p.set_defaults(handler=_cmd_doctor)


def _stop_group(proc) -> None:
    """SIGTERM the launcher's process group (it stops its workers), then SIGKILL after 30 s."""
    import os
    import signal
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cmd_doctor(args: argparse.Namespace) -> int:
    import json
    import subprocess

    from multigpu.diagnostics.doctor import MARKER

    import math

    validate.positive_seconds(args.timeout, "--timeout", LaunchError)
    for flag, value in (("--checkpoint-gb", args.checkpoint_gb), ("--max-clock-skew", args.max_clock_skew),
                        ("--expect-gbps", args.expect_gbps)):
        if not (math.isfinite(value) and 0 <= value <= 1e9):
            raise LaunchError(f"{flag} {value} is not a number from 0 to 1e9.", f"e.g. {flag} 2.")
    for size in args.sizes.split(","):
        try:
            ok = 0 < float(size) <= 65536
        except ValueError:
            ok = False
        if not ok:
            raise LaunchError(f"--sizes {args.sizes!r}: {size!r} is not a size in MiB.", "e.g. --sizes 1,256.")
    command = [sys.executable, "-m", "multigpu", "run", *launch_flags_of(args), "--tee-prefix", "never",
               "-m", "multigpu.diagnostics.doctor", "--out", args.out, "--checkpoint-gb", str(args.checkpoint_gb),
               "--sizes", args.sizes, "--max-clock-skew", str(args.max_clock_skew),
               "--expect-gbps", str(args.expect_gbps), "--report-only"]
    import threading

    verdicts: list[dict] = []

    def pump(stream) -> None:  # a thread: a stuck rank (a dead NFS mount) must not block the timeout
        for line in stream:
            if line.startswith(MARKER):
                verdicts.append(json.loads(line[len(MARKER):]))
            else:
                print(line, end="", flush=True)

    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True) as proc:
        reader = threading.Thread(target=pump, args=(proc.stdout,), daemon=True)
        reader.start()
        try:
            status = proc.wait(timeout=args.timeout)
        except BaseException as exc:  # the timeout, or Ctrl-C (its own session: the terminal's signal misses it)
            _stop_group(proc)
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            raise LaunchError(f"doctor did not finish in {args.timeout} s (a node that never joined, or a rank stuck "
                              "on the output folder).", "check that every node was started and that --out is "
                              "mounted; a lower --rdzv-timeout fails sooner.") from None
        reader.join(timeout=10)
    verdict = verdicts[-1] if verdicts else None
    if verdict is None:
        if status == 0:  # another node holds rank 0: the report is printed there
            print("multigpu doctor: this node's checks ran; the report is printed on the node of rank 0", flush=True)
        return status  # non-zero: the launch itself failed, and the launcher's own line says why
    return 1 if verdict["faults"] else 0


# ----------------------------------------------------------------------------------------- plot


def _cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multigpu.plots import find_runs, plot_runs

    runs = find_runs(args.folders)
    out = Path(args.out) if args.out else (runs[0] if len(runs) == 1 and len(args.folders) == 1
                                           else Path(args.folders[0])) / "curves.png"
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--out {out} does not end in .png.", "give a file name like curves.png.")
    plot_runs(runs, out, args.metric)
    print(f"wrote {out} ({len(runs)} run(s): {', '.join(r.name for r in runs[:8])}{', ...' if len(runs) > 8 else ''})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="multigpu",
        description="Run one PyTorch training script on every GPU, several machines, Slurm, or a GPU pool.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_run_parser(sub)
    _add_slurm_parser(sub)
    _add_queue_parser(sub)
    _add_checkpoint_parser(sub)
    _add_check_parser(sub)
    _add_doctor_parser(sub)
    env = sub.add_parser("env", help="print what this machine offers (torch, GPUs, NCCL, variables); --check "
                         "runs an all-reduce", description="What a bug report needs about this machine. With "
                         "--check: an all-reduce through `multigpu run` on the chosen devices, checked and timed.")
    env.add_argument("--check", action="store_true", help="run an all-reduce smoke test and report bus bandwidth")
    env.add_argument("--nproc", type=int, metavar="N", help="processes for --check (default: one per GPU, or 1)")
    env.add_argument("--gpus", metavar="IDS", help="GPUs for --check, e.g. 0,1")
    env.add_argument("--cpu", action="store_true", help="--check with CPU processes (gloo)")
    env.set_defaults(handler=_cmd_env)
    plot = sub.add_parser("plot", help="PNG loss curves of a run folder, or of every run in a queue folder",
                          description="Draw train/valid loss and the validation metric against optimizer step "
                          "from the metrics.csv and steps.csv files runs write (needs matplotlib).")
    plot.add_argument("folders", nargs="+", metavar="OUT_DIR", help="a run's out_dir, or a queue's --out folder")
    plot.add_argument("--out", metavar="FILE.png", help="where to write (default: curves.png in the folder given)")
    plot.add_argument("--metric", metavar="NAME", help="the metric for the right panel, e.g. valid_accuracy")
    plot.set_defaults(handler=_cmd_plot)
    return parser


def _version() -> str:
    from multigpu import __version__

    return f"multigpu {__version__}"


def _with_default_actions(argv: list[str]) -> list[str]:
    """``multigpu slurm train.py`` means ``multigpu slurm submit train.py`` (the short form users type)."""
    if len(argv) >= 2 and argv[0] == "slurm" and argv[1] not in (*SLURM_ACTIONS, "-h", "--help"):
        return ["slurm", "submit", *argv[1:]]
    return argv


def _os_error_line(exc: OSError) -> str:
    what = exc.strerror or type(exc).__name__
    names = [str(n) for n in (exc.filename, exc.filename2) if n is not None]
    return (f"multigpu: error: {what}{': ' + ' -> '.join(names) if names else ''}. "
            "HINT: check the path, that its folder exists, free disk space and permissions.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = _with_default_actions(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except MultiGPUError as exc:
        print(exc.one_line(), file=sys.stderr)
        return 2
    except OSError as exc:  # a file or folder the system refused: the user's to fix, not a bug of ours
        print(_os_error_line(exc), file=sys.stderr)
        return 2
    except UnicodeError as exc:  # text that cannot be written (a lone surrogate from a YAML escape)
        print(f"multigpu: error: {' '.join(str(exc).split())[:200]}. HINT: use plain UTF-8 text in names, paths "
              "and values.", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("multigpu: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
