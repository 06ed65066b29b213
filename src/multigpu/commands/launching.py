"""``multigpu run``: its flags (and torchrun's spellings), checked, handed to the local launcher.

The device and node flags are shared: ``doctor`` hands the same ones to ``run``. ``multigpu slurm`` is
in commands/slurm.py. Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multigpu import validate
from multigpu.errors import LaunchError
from multigpu.launch.knobs import (
    DEVICES,
    LAUNCH_GROUPS,
    LOGS,
    NODES,
    REPLICAS,
    TORCHRUN,
    add_knobs,
    check_knobs,
    spellings,
)

if TYPE_CHECKING:
    from multigpu.launch.local import LaunchRequest

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

  2 replica groups that keep training when one dies (torchft; a dead group restarts and heals):
  multigpu run --replica-groups 2 --max-restarts 3 train.py

Inside the script, `run = mg.init()` finds all of this; the same script also runs under torchrun
and srun unchanged. Batch sizes are per process: the global batch is batch x processes.
"""


def add_launch_flags(p: argparse.ArgumentParser, rdzv_timeout: int = 900) -> None:
    """Devices and nodes: the flags `multigpu run` and `multigpu doctor` share (both spellings torchrun
    accepts, ``--nproc-per-node`` and ``--nproc_per_node``)."""
    add_knobs(p, LAUNCH_GROUPS, {"rdzv_timeout": rdzv_timeout})


#: torchrun flags that `multigpu run` refuses, with why and what to use instead (flag -> (takes a value, hint)).
REFUSED_TORCHRUN_FLAGS = {
    "--no-python": (
        False,
        "multigpu run starts Python scripts and modules (its worker wrapper is Python); run "
        "another executable under torchrun --no-python",
    ),
    "--redirects": (
        True,
        "every rank's output reaches this terminal and its stderr is kept per rank in --log-dir; "
        "use --log-dir DIR",
    ),
    "--tee": (
        True,
        "every rank's stderr is already copied to --log-dir while it reaches the terminal; use --log-dir "
        "DIR (and --tee-prefix always for [rankN] prefixes)",
    ),
    "--local-ranks-filter": (
        True,
        "every rank's output reaches the terminal, prefixed [rankN] in logs; use "
        "--tee-prefix always and grep, or --log-dir",
    ),
    "--duplicate-stdout-filters": (True, "use --log-dir DIR: each rank's stderr is kept there"),
    "--duplicate-stderr-filters": (True, "use --log-dir DIR: each rank's stderr is kept there"),
    "--logs-specs": (True, "a logs-specs plugin is code loaded by name; use --log-dir DIR"),
    "--event-log-handler": (
        True,
        "event handlers are plugins loaded by name; multigpu prints its own one-line events",
    ),
    "--numa-binding": (
        True,
        "bind with numactl or Slurm's --cpu-bind; multigpu sets OMP_NUM_THREADS per process",
    ),
    "--signals-to-handle": (
        True,
        "multigpu forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 (preemption) itself",
    ),
    "--virtual-local-rank": (
        False,
        "each process sees its own GPU as cuda:0 only through CUDA_VISIBLE_DEVICES; use "
        "--gpus-per-proc or run.device",
    ),
}
_REFUSED_SHORT = {"-r": "--redirects", "-t": "--tee"}


class _Refused(argparse.Action):
    """A torchrun flag multigpu does not take: one line saying why and what to use (exit 2)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: "str | None" = None,
    ) -> None:
        name = _REFUSED_SHORT.get(option_string or "", option_string or "")
        canonical = "--" + name[2:].replace("_", "-")
        raise LaunchError(
            f"torchrun's {option_string} is not a multigpu run flag.",
            REFUSED_TORCHRUN_FLAGS[canonical][1] + ".",
        )


def add_torchrun_flags(p: argparse.ArgumentParser) -> None:
    """The rest of torchrun's flags: taken with torchrun's meaning, or refused with a reason."""
    add_knobs(p, (TORCHRUN,))
    g = next(group for group in p._action_groups if group.title == TORCHRUN)
    for flag, (takes_value, _hint) in REFUSED_TORCHRUN_FLAGS.items():
        short = [k for k, v in _REFUSED_SHORT.items() if v == flag]
        g.add_argument(
            *short,
            *spellings(flag),
            action=_Refused,
            nargs=None if takes_value else 0,
            help=argparse.SUPPRESS,
        )


def add_run_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script on every GPU (or N processes) of this machine, or as one node of several",
        description="Start one process per GPU (or --nproc CPU processes) on PyTorch's elastic agent.",
        epilog=RUN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_knobs(p, (DEVICES, NODES, LOGS, REPLICAS))
    add_torchrun_flags(p)
    p.add_argument(
        "-m", "--module", action="store_true", help="the target is a module, run as with python -m"
    )
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(handler=_cmd_run)


def _check_run_flags(args: argparse.Namespace) -> None:
    check_knobs(args)
    if args.log_dir is not None:
        from multigpu.launch.local import prepare_log_dir

        prepare_log_dir(args.log_dir)


def fold_torchrun_flags(args: argparse.Namespace) -> None:
    """torchrun's ways of saying what our own flags say, folded into them (each error names the flag)."""
    if args.start_method not in (None, "spawn"):
        raise LaunchError(
            f"--start-method {args.start_method[:20]!r}: multigpu run starts workers with spawn only.",
            "drop --start-method: each worker needs a fresh interpreter (a forked one inherits the "
            "launcher's threads and CUDA state).",
        )
    if args.standalone and (
        args.nnodes not in ("1", "1:1") or args.rdzv_endpoint or args.master_addr
    ):
        raise LaunchError(
            "--standalone is one machine; it contradicts --nnodes/--rdzv-endpoint/--master-addr.",
            "drop --standalone for a job of several machines.",
        )
    if args.rdzv_conf:
        items = args.rdzv_conf.split(",")
        for item in items:
            key, _, value = item.partition("=")
            if key.strip() not in ("join_timeout", "timeout") or not validate.is_digits(
                value.strip()
            ):
                raise LaunchError(
                    f"--rdzv-conf {item[:60]!r}: multigpu run takes join_timeout=SECONDS only.",
                    "write --rdzv-conf join_timeout=900 (or --rdzv-timeout 900).",
                )
            if len(items) > 1:
                raise LaunchError(
                    f"--rdzv-conf {args.rdzv_conf[:60]!r} gives the join timeout more than once.",
                    "give it once: --rdzv-conf join_timeout=900.",
                )
            args.rdzv_timeout = validate.whole_number(
                value.strip(), "--rdzv-conf join_timeout", LaunchError
            )
    backend = args.rdzv_backend
    if backend in ("etcd", "etcd-v2"):
        raise LaunchError(
            f"--rdzv-backend {backend}: the etcd rendezvous needs an etcd server of its own.",
            "use --rdzv-backend c10d --rdzv-endpoint HOST:PORT (the first node hosts it: nothing to run).",
        )
    if backend not in (None, "c10d", "static"):
        raise LaunchError(
            f"--rdzv-backend {backend[:40]!r} is not c10d or static.",
            "use c10d with --rdzv-endpoint HOST:PORT, or static with --master-addr/--master-port.",
        )
    # torchrun's static rendezvous reads HOST:PORT from the endpoint
    if backend == "static" and args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        port_number = int(port) if validate.is_digits(port) else None
        args.master_addr, args.master_port, args.rdzv_endpoint = host or None, port_number, None
    if backend == "c10d" and not args.rdzv_endpoint and args.master_addr and args.master_port:
        args.rdzv_endpoint, args.master_addr, args.master_port = (
            f"{args.master_addr}:{args.master_port}",
            None,
            None,
        )


def resolve_nproc(
    nproc: "int | str | None", visible: list[str], cpu: bool
) -> tuple["int | None", bool]:
    """torchrun's ``--nproc-per-node auto|gpu|cpu`` as a number of processes (and whether they are CPU ones)."""
    import os

    if nproc == "gpu":
        if not visible or cpu:
            raise LaunchError(
                "--nproc-per-node gpu: no GPU is visible here.",
                "give a number of CPU processes, e.g. --nproc 2, or run on a GPU machine.",
            )
        return None, cpu
    if nproc == "auto":
        return (
            (None, cpu)
            if visible and not cpu
            else (min(os.cpu_count() or 1, validate.MAX_PROCS_PER_NODE), True)
        )
    if nproc == "cpu":
        return min(os.cpu_count() or 1, validate.MAX_PROCS_PER_NODE), True
    if isinstance(nproc, str):  # nproc_value lets only auto, gpu and cpu through
        raise LaunchError(
            f"--nproc {nproc[:40]!r} is not a number of processes, auto, gpu or cpu.",
            "e.g. --nproc 2.",
        )
    return nproc, cpu


def plan_run(args: argparse.Namespace) -> "LaunchRequest":
    """The launch a parsed ``multigpu run`` (or torchrun) command line asks for, checked; nothing started."""
    from multigpu.launch.devices import plan_devices, visible_gpus
    from multigpu.launch.local import LaunchRequest, split_command
    from multigpu.launch.rendezvous import plan_rendezvous

    fold_torchrun_flags(args)
    _check_run_flags(args)
    command = split_command(
        None if args.module else args.script, args.script if args.module else None, args.script_args
    )
    visible = [] if args.cpu else visible_gpus()
    nproc, cpu = resolve_nproc(args.nproc, visible, args.cpu)
    devices = plan_devices(
        [] if cpu else visible,
        gpus=args.gpus,
        nproc=nproc,
        gpus_per_proc=args.gpus_per_proc,
        cpu=cpu,
        procs_per_gpu=args.procs_per_gpu,
    )
    rendezvous = plan_rendezvous(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        timeout_s=args.rdzv_timeout,
    )
    if rendezvous.backend == "static" and rendezvous.max_nodes > 1 and args.max_restarts:
        raise LaunchError(
            "--max-restarts with a static rendezvous (--master-addr/--master-port) restarts this node's "
            "workers only: the other nodes' would wait for them in the old group.",
            "meet in a c10d rendezvous instead, the same on every node: --rdzv-endpoint HOST:PORT "
            "(torchrun's spelling works too), or leave --max-restarts out.",
        )
    return LaunchRequest(
        command=command,
        devices=devices,
        rendezvous=rendezvous,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        verbose=args.verbose,
        stop_timeout_s=args.stop_timeout,
        tee_prefix=args.tee_prefix,
        debug=args.debug,
        monitor_interval=args.monitor_interval or 0.1,
        role=args.role or "default",
        local_addr=args.local_addr,
        profile=args.profile,
        exit_timeout_s=args.exit_timeout,
    )


def check_script_arguments(args: argparse.Namespace) -> None:
    """A recipe's YAML file and KEY=VALUE overrides, checked before torch loads anywhere (see
    :mod:`multigpu.trainer.recipe_args`): a typo is its one line now, not after every rank's import.
    ``--fresh``/``--resume PATH`` become the recipe's own overrides here."""
    fresh, resume = getattr(args, "fresh", False), getattr(args, "resume", None)
    if args.module or not args.script or not Path(args.script).is_file():
        # a missing script: the launcher's own line follows
        if args.module and (fresh or resume is not None):
            raise LaunchError(
                "--fresh and --resume are a recipe's settings (trainer.fresh, trainer.resume_from); "
                "a module run with -m is not read here.",
                "pass them to it as trainer.fresh=true or "
                "trainer.resume_from=PATH, or run the script by its file.",
            )
        return
    from multigpu.trainer.recipe_args import (
        check_recipe_arguments,
        resume_override,
        settings_section,
    )

    if fresh or resume is not None:
        section = settings_section(args.script, args.script_args)
        first = args.script_args[0] if args.script_args else ""
        if section is None and first.endswith((".yaml", ".yml")) and not Path(first).is_file():
            raise LaunchError(
                f"the recipe's settings file {first!r} does not exist.",
                "check the path (it is relative to the current folder).",
            )
        if section is None:
            raise LaunchError(
                f"--fresh and --resume set a recipe's trainer settings, and {args.script} reads none "
                "this launcher can find (a dataclass field of type mg.TrainerSettings filled by "
                "multigpu.config.load, with an optional YAML file and KEY=VALUE arguments).",
                "in your own code: TrainerSettings(fresh=True) or resume_from=PATH; or start from an "
                "empty trainer.out_dir.",
            )
        if fresh and resume is not None:
            raise LaunchError(
                "--fresh starts without a checkpoint and --resume from one.", "give one of them."
            )
        args.script_args = [*args.script_args, resume_override(section, fresh, resume)]
    check_recipe_arguments(args.script, args.script_args)


def _cmd_run(args: argparse.Namespace) -> int:
    check_script_arguments(args)
    if (
        args.replica_groups is not None
        or args.replica_group is not None
        or args.lighthouse is not None
    ):
        from multigpu.commands.replica_groups import run_replica_groups
        from multigpu.launch.local import import_torch_quietly

        return run_replica_groups(args, quiet=lambda: import_torch_quietly(args.verbose))
    if args.simulate_nodes is not None:
        from multigpu.launch.devices import visible_gpus
        from multigpu.launch.flags import RunFlags
        from multigpu.launch.local import split_command
        from multigpu.launch.simulate import simulate

        # No torch here: the simulated nodes are `multigpu run` processes of their own.
        fold_torchrun_flags(args)
        _check_run_flags(args)
        command = split_command(
            None if args.module else args.script,
            args.script if args.module else None,
            args.script_args,
        )
        nproc, cpu = resolve_nproc(args.nproc, [] if args.cpu else visible_gpus(), args.cpu)
        flags = RunFlags.from_args(args).replace(nproc=nproc, cpu=cpu)
        return simulate(
            args.simulate_nodes,
            command,
            flags,
            visible=[] if cpu else visible_gpus(),
            gpus=args.gpus,
            clashing={
                "--nnodes": args.nnodes != "1",
                "--node-rank": args.node_rank,
                "--master-addr": args.master_addr,
                "--master-port": args.master_port,
                "--rdzv-endpoint": args.rdzv_endpoint,
                "--log-dir": args.log_dir,
            },
        )
    from multigpu.launch.local import launch

    # torch loads in launch(), after every flag is checked: a refused flag is one line in a tenth of a second.
    return launch(plan_run(args))
