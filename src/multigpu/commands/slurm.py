"""``multigpu slurm``: its options (shared with ``queue --slurm``), checked, handed to launch/slurm.py.

Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from multigpu import validate
from multigpu.errors import LaunchError, visible
from multigpu.fileio import Folder, read_regular
from multigpu.launch.knobs import BY_NAME, check_knobs
from multigpu.validate import whole_flag

if TYPE_CHECKING:
    from multigpu.launch.slurm_options import SlurmOptions

SLURM_EXAMPLES = """\
examples:
  multigpu slurm --nodes 2 --gpus-per-node 4 --time 20:00:00 train.py hparams.yaml
  multigpu slurm --nodes 1 --gres gpu:a100:8 --partition gpu --account proj --qos high train.py
  multigpu slurm --sbatch-arg=--gpus=8 --nodes 2 train.py          GPUs as sbatch takes them (4 per node)
  multigpu slurm --dry-run --nodes 2 --gpus-per-node 4 train.py     write and show the script only
  multigpu slurm --nodes 4 --replica-groups 4 --max-restarts 3 train.py   a node dies, the others keep training
  multigpu slurm status                your multigpu jobs of the last 7 days, ended ones too
  multigpu slurm status 12345          state (pending: why), exit code, elapsed, restarts, log path
  multigpu slurm logs 12345            the end of the job's log
  multigpu slurm cancel 12345

The script lands in the run folder (--run-dir) with the job's log; it runs one `multigpu run` per node
with a c10d rendezvous on the first node. --signal=USR1@90 and --requeue let the Trainer checkpoint
before the time limit and continue in the requeued job.
"""

SLURM_ACTIONS = ("submit", "status", "logs", "cancel")


def add_slurm_job_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Slurm job")
    g.add_argument("--nodes", type=whole_flag, default=1, metavar="N", help="nodes (default 1)")
    g.add_argument(
        "--gpus-per-node", metavar="[TYPE:]G", help="GPUs per node, e.g. 4 or a100:4 (0: CPU nodes)"
    )
    g.add_argument(
        "--gres",
        metavar="gpu[:TYPE]:G",
        help="GPUs per node as a generic resource, e.g. gpu:a100:4 "
        "(--sbatch-arg=--gres=..., --gpus=... and --gpus-per-task=... are read too)",
    )
    g.add_argument(
        "--nproc-per-node",
        type=whole_flag,
        metavar="P",
        help="processes per node (default: one per GPU)",
    )
    g.add_argument("--time", metavar="T", help="time limit, e.g. 20:00:00")
    g.add_argument("--partition", metavar="P")
    g.add_argument("--account", metavar="A")
    g.add_argument("--qos", metavar="Q", help="quality of service, e.g. high")
    g.add_argument("--constraint", metavar="C", help="node features, e.g. a100 or 'a100|h100'")
    g.add_argument(
        "--cpus-per-task",
        type=whole_flag,
        metavar="C",
        help="CPU cores for each node's task (default: 4 per GPU process, 1 per CPU process)",
    )
    g.add_argument("--mem", metavar="M", help="memory per node, e.g. 64G")
    g.add_argument(
        "--job-name",
        metavar="NAME",
        help="the name squeue shows (default: 8 characters, distinct per job, e.g. trai-k3f)",
    )
    g.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="another #SBATCH option in its long form, e.g. --sbatch-arg=--exclusive (repeatable)",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="write the script(s), print, do not submit (multigpu "
        "queue without --slurm: each run's plan and command, none started)",
    )


def _gpus_per_node(text: Optional[str]) -> tuple[Optional[int], Optional[str]]:
    """``4`` or ``a100:4`` -> (4, "a100"); ASCII digits only."""
    if text is None:
        return None, None
    match = re.fullmatch(r"(?:([A-Za-z0-9_.-]{1,64}):)?([0-9]{1,4})", text)
    if not match:
        raise LaunchError(
            f"--gpus-per-node {text[:40]} is not a GPU count.",
            "write --gpus-per-node 4, or with a GPU type --gpus-per-node a100:4 (0: CPU nodes).",
        )
    return int(match.group(2)), match.group(1)


def slurm_options_from_args(args: argparse.Namespace) -> SlurmOptions:
    from multigpu.launch.slurm import SlurmOptions

    gpus, gpu_type = _gpus_per_node(args.gpus_per_node)
    return SlurmOptions(
        nodes=args.nodes,
        gpus_per_node=gpus,
        gpu_type=gpu_type,
        gres=args.gres,
        nproc_per_node=args.nproc_per_node,
        time=args.time,
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        constraint=args.constraint,
        cpus_per_task=args.cpus_per_task,
        mem=args.mem,
        job_name=args.job_name,
        max_restarts=getattr(args, "max_restarts", 0) or 0,
        extra=tuple(args.sbatch_arg),
        replica_groups=getattr(args, "replica_groups", None),
        min_replicas=getattr(args, "min_replicas", 1),
        heartbeat_timeout=getattr(args, "heartbeat_timeout", 5.0),
    )


def add_slurm_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "slurm",
        help="submit a training script as a Slurm job; status|logs|cancel JOBID",
        description="Write a readable sbatch script into the run folder and submit it. "
        "`multigpu slurm train.py ...` is short for `multigpu slurm submit train.py ...`.",
        epilog=SLURM_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    submit = actions.add_parser(
        "submit",
        help="write the sbatch script and submit it (the default action)",
        epilog=SLURM_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_slurm_job_options(submit)
    submit.add_argument(
        "--run-dir",
        metavar="DIR",
        help="folder for the script and log (default: outputs/slurm/<name>-<time>)",
    )
    # run's own knobs
    BY_NAME["max_restarts"].add_to(submit, help="restarts of the workers inside the job")
    replica = submit.add_argument_group("replica groups (torchft; docs/fault-tolerance.md)")
    BY_NAME["replica_groups"].add_to(
        replica,
        help="one replica group per node (R = --nodes): a node that fails is "
        "restarted by its own agent (--max-restarts) and heals while the others keep "
        "training; the lighthouse runs on the first node",
    )
    for name in ("min_replicas", "heartbeat_timeout"):
        BY_NAME[name].add_to(replica)
    submit.add_argument(
        "-m", "--module", action="store_true", help="the target is a module, run as with python -m"
    )
    submit.add_argument("script", help="training script (or module with -m)")
    submit.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    submit.set_defaults(handler=_cmd_slurm_submit)
    for name, text in (
        (
            "status",
            "a job's state (pending: why), exit code, elapsed time, restarts and log; "
            "without a job id, your multigpu jobs of the last days, ended ones too",
        ),
        ("logs", "the end of a job's log"),
        ("cancel", "cancel a job"),
    ):
        action = actions.add_parser(
            name,
            help=text,
            description=text + ". Read from sacct (job accounting), else "
            "scontrol, which forgets jobs minutes after they end.",
        )
        action.add_argument(
            "job_id",
            nargs="?" if name == "status" else None,
            help="the Slurm job id (123, or 123_4 for one task of an array)",
        )
        if name == "logs":
            action.add_argument(
                "--lines",
                type=whole_flag,
                default=50,
                metavar="N",
                help="how many lines (default 50)",
            )
        if name == "status":
            action.add_argument(
                "--days",
                type=whole_flag,
                default=7,
                metavar="D",
                help="without a job id: jobs submitted in the last D days (default 7)",
            )
        action.set_defaults(handler=_cmd_slurm_job)


def _new_run_dir(stem: str, when: float) -> tuple[str, Path]:
    """A job name and a run folder that no earlier job of this script has: the folder is created here
    (exclusively), one second later is tried while it exists, and the name follows the same second."""
    import time

    from multigpu.launch.slurm import timed_job_name

    base = "".join(c if c.isalnum() or c in "._-" else "_" for c in stem).lstrip(".-") or "job"
    jobs = Folder("outputs").create().child("slurm")
    for step in range(3600):
        moment = int(when) + step
        try:
            folder = jobs.make(f"{base}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(moment))}")
        except FileExistsError:
            continue
        return timed_job_name(base, moment), folder.path.resolve()
    raise LaunchError(
        "no free run folder under outputs/slurm for this second or the next hour.",
        "give --run-dir.",
    )


def _cmd_slurm_submit(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from multigpu.commands.launching import check_script_arguments
    from multigpu.launch import slurm
    from multigpu.launch.local import split_command

    command = split_command(
        None if args.module else args.script, args.script if args.module else None, args.script_args
    )
    check_knobs(args)  # run's own flags here (--max-restarts, the replica groups'): run's bounds
    # a typo is one line now, not a job that fails after its wait in the queue
    check_script_arguments(args)
    options = slurm_options_from_args(args)
    if options.gpu_request() is None and options.gpus_per_node is None:
        options = dataclasses.replace(options, gpus_per_node=0)
    options.validate()
    stem = Path(args.script).stem if not args.module else args.script.rsplit(".", 1)[-1]
    if args.run_dir:
        run_dir, name = Path(args.run_dir).resolve(), slurm.timed_job_name(stem, time.time())
    else:
        name, run_dir = _new_run_dir(stem, time.time())
    job = slurm.SlurmJob(
        command=command,
        run_dir=run_dir,
        options=dataclasses.replace(options, job_name=options.job_name or name),
    )
    if args.dry_run:
        path = slurm.write(job)
        print(read_regular(path, 1 << 20).decode())
        print(f"# written to {path}; submit with: sbatch {path}")
        return 0
    job_id = slurm.submit(job)
    print(
        f"submitted job {job_id} ({job.options.job_name}, {job.options.gpus} GPU(s) x {job.options.nodes} node(s))"
    )
    print(f"  script: {job.script_path}")
    print(f"  log:    {str(job.log_pattern).replace('%j', job_id)}")
    print(f"  follow: multigpu slurm status {job_id} | multigpu slurm logs {job_id}")
    return 0


def _cmd_slurm_job(args: argparse.Namespace) -> int:
    from multigpu.launch import slurm, slurm_state

    if args.action == "status" and args.job_id is None:
        days = validate.count(args.days, "--days", LaunchError, high=3650)
        rows, source = slurm_state.my_jobs(days)
        print(f"multigpu: jobs of {slurm_state.current_user()} ({source}):")
        print(visible(slurm_state.table(rows), keep_newlines=True) if rows else "  none")
        return 0
    job_id = slurm.check_job_id(args.job_id)
    if args.action == "status":
        for record in slurm_state.job_records(job_id):
            print(visible(record.line()))
    elif args.action == "cancel":
        slurm.cancel(job_id)
        print(f"cancelled job {job_id}")
    else:
        lines = validate.count(args.lines, "--lines", LaunchError, high=100_000)
        path, tail, total = slurm_state.log_tail(job_id, lines)
        print(f"==> {visible(str(path))} (last {len(tail)} of {total} lines)")
        print("\n".join(visible(line) for line in tail))
    return 0
