"""The ``multigpu`` command: a thin layer that parses flags and calls launch, queue and diagnostics.

Nothing imports this module. Every :class:`MultiGPUError` becomes one line on stderr with its HINT and
exit status 2 (bad input, nothing was started); a failed run returns the failing worker's status.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from multigpu.errors import MultiGPUError

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

Inside the script, `run = mg.init()` finds all of this; the same script also runs under torchrun
and srun unchanged. Batch sizes are per process: the global batch is batch x processes.
"""


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script on every GPU (or N processes) of this machine, or as one node of several",
        description="Start one process per GPU (or --nproc CPU processes) on PyTorch's elastic agent.",
        epilog=RUN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dev = p.add_argument_group("devices and processes")
    dev.add_argument("--gpus", metavar="IDS", help="GPUs to use, e.g. 0,2,3 or 0-3 (default: every visible GPU)")
    dev.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, metavar="N",
                     help="processes on this machine (default: one per GPU, or 1 on a CPU machine)")
    dev.add_argument("--gpus-per-proc", type=int, default=1, metavar="K",
                     help="GPUs owned by each process, for model-parallel strategies (default 1)")
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
    nodes.add_argument("--rdzv-timeout", type=int, default=900, metavar="S",
                       help="seconds to wait for every node to join (default 900)")
    misc = p.add_argument_group("failures and logs")
    misc.add_argument("--max-restarts", type=int, default=0, metavar="K",
                      help="restart all workers up to K times when one fails (default 0)")
    misc.add_argument("--log-dir", metavar="DIR", help="keep each rank's stderr here (default: a temp dir, "
                      "removed after a successful run)")
    misc.add_argument("--verbose", action="store_true", help="show torch elastic's own log lines")
    p.add_argument("-m", "--module", action="store_true", help="the target is a module, run as with python -m")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(handler=_cmd_run)


def _visible_gpus() -> list[str]:
    import os

    import torch

    count = torch.cuda.device_count()
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return [str(i) for i in range(count)]
    ids = [part.strip() for part in raw.split(",") if part.strip()]
    return ids[:count]


def _cmd_run(args: argparse.Namespace) -> int:
    from multigpu.launch.devices import plan_devices
    from multigpu.launch.local import LaunchRequest, launch, plan_rendezvous, split_command

    if args.max_restarts < 0:
        raise MultiGPUError(f"--max-restarts {args.max_restarts} must be 0 or more.", "use --max-restarts 0..K.")
    command = split_command(
        None if args.module else args.script, args.script if args.module else None, args.script_args
    )
    devices = plan_devices(
        [] if args.cpu else _visible_gpus(), gpus=args.gpus, nproc=args.nproc,
        gpus_per_proc=args.gpus_per_proc, cpu=args.cpu,
    )
    rendezvous = plan_rendezvous(
        nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
        master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        timeout_s=args.rdzv_timeout,
    )
    request = LaunchRequest(
        command=command, devices=devices, rendezvous=rendezvous, max_restarts=args.max_restarts,
        log_dir=args.log_dir, verbose=args.verbose,
    )
    return launch(request)


def _cmd_env(args: argparse.Namespace) -> int:
    from multigpu.diagnostics.environment import report

    print(report())
    return 0


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
        found = checkpoint.list_checkpoints(args.directory)
        if not found:
            print(f"no checkpoints in {args.directory}")
            return 1
        for info in found:
            try:
                manifest = checkpoint.verify(info.path)
                kind = "sharded" if sharded.is_sharded(info.path) else "replicated"
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
    if not sharded.is_sharded(path):
        info = checkpoint.latest(path)
        if info is None:
            raise CheckpointError(f"no checkpoint at {path}.", "give a step-N folder or the folder holding them.")
        path = info.path
    out = sharded.consolidate(path, Path(args.out) if args.out else None)
    print(f"consolidated {path} -> {out / 'state.pt'} (load with torch.load(..., weights_only=True)['model'])")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multigpu",
        description="Run one PyTorch training script on every GPU, several machines, Slurm, or a GPU pool.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_run_parser(sub)
    _add_checkpoint_parser(sub)
    env = sub.add_parser("env", help="print what this machine offers (torch, GPUs, backends, detected launcher)")
    env.set_defaults(handler=_cmd_env)
    return parser


def _version() -> str:
    from multigpu import __version__

    return f"multigpu {__version__}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except MultiGPUError as exc:
        print(exc.one_line(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("multigpu: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
