"""``multigpu env``, ``check``, ``doctor`` and ``plot``: what this machine offers, whether a script
computes on N processes what it does on one, a pre-flight of a job, and loss curves."""

from __future__ import annotations

import argparse
from typing import IO, Any

from multigpu import validate
from multigpu.commands.launching import add_launch_flags
from multigpu.errors import ConfigError, LaunchError, visible
from multigpu.validate import whole_flag


def add_env_parser(sub: argparse._SubParsersAction[Any]) -> None:
    env = sub.add_parser(
        "env",
        help="print what this machine offers (torch, GPUs, NCCL, variables); --check "
        "runs an all-reduce",
        description="What a bug report needs about this machine. With "
        "--check: an all-reduce through `multigpu run` on the chosen devices, checked and timed.",
    )
    env.add_argument(
        "--check", action="store_true", help="run an all-reduce smoke test and report bus bandwidth"
    )
    env.add_argument(
        "--nproc",
        type=whole_flag,
        metavar="N",
        help="processes for --check (default: one per GPU, or 1)",
    )
    env.add_argument("--gpus", metavar="IDS", help="GPUs for --check, e.g. 0,1")
    env.add_argument("--cpu", action="store_true", help="--check with CPU processes (gloo)")
    env.set_defaults(handler=_cmd_env)


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


def add_check_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "check",
        help="prove your script computes on N processes what it computes on one",
        description="Run the script for K optimizer steps on N processes and on 1 process with N "
        "times the batch, compare every step's loss and the weights, and say why they differ.",
        epilog="examples:\n  multigpu check --nproc 2 --steps 5 train.py hparams.yaml\n"
        "  multigpu check --nproc 4 -m mypkg.train --lr 3e-4\n"
        "  multigpu check --nproc 2 --procs-per-gpu 2 train.py   (one GPU: two processes share it)\n\n"
        "Exit 0: equal within a tolerance "
        "scaled to the dtype; 1: different, or equal numbers but a mistake found (the causes are "
        "printed); 2: the script did not run; 3: unverified (the numbers agree, but what the runs "
        "trained on could not be seen).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc",
        type=whole_flag,
        default=2,
        metavar="N",
        help="processes to compare with one (default 2)",
    )
    p.add_argument(
        "--steps",
        type=whole_flag,
        default=5,
        metavar="K",
        help="optimizer steps in each run (default 5)",
    )
    p.add_argument("--cpu", action="store_true", help="CPU processes even where GPUs are visible")
    p.add_argument(
        "--procs-per-gpu",
        type=whole_flag,
        default=1,
        metavar="K",
        help="the N processes share the GPUs, K to a GPU (one GPU: --nproc 2 --procs-per-gpu 2; default 1)",
    )
    p.add_argument(
        "--tolerance", type=float, metavar="T", help="relative tolerance (default: from the dtype)"
    )
    p.add_argument("--keep", action="store_true", help="keep the per-step records")
    p.add_argument(
        "--show-output",
        action="store_true",
        help="print the script's own output (stdout and stderr) of both runs before the comparison",
    )
    p.add_argument(
        "--timeout",
        type=whole_flag,
        default=600,
        metavar="S",
        help="seconds each run may take (default 600)",
    )
    p.add_argument(
        "-m", "--module", action="store_true", help="the target is a module, run as with python -m"
    )
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(handler=_cmd_check)


def _cmd_check(args: argparse.Namespace) -> int:
    from multigpu.commands.launching import check_script_arguments
    from multigpu.diagnostics.check import check
    from multigpu.launch.local import split_command

    validate.positive_seconds(args.timeout, "--timeout", LaunchError)
    if args.tolerance is not None and not (0 < args.tolerance < 1e3):
        raise LaunchError(
            f"--tolerance {args.tolerance} is not a positive number.", "e.g. --tolerance 1e-4."
        )
    command = split_command(
        None if args.module else args.script, args.script if args.module else None, args.script_args
    )
    check_script_arguments(args)
    return check(
        list(command),
        args.nproc,
        args.steps,
        cpu=args.cpu,
        tolerance=args.tolerance,
        keep=args.keep,
        timeout_s=args.timeout,
        out=lambda line: print(line, flush=True),
        procs_per_gpu=args.procs_per_gpu,
        show_output=args.show_output,
    )


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


def add_doctor_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "doctor",
        help="pre-flight of the nodes a job will use: versions, clocks, shared folder, "
        "disk, GPUs, all-reduce bandwidth",
        description="Check the machines before a long job.",
        epilog=DOCTOR_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_flags(p, rdzv_timeout=60)
    g = p.add_argument_group("checks")
    g.add_argument(
        "--out", default=".", metavar="DIR", help="the job's output folder (default: here)"
    )
    g.add_argument(
        "--checkpoint-gb",
        type=float,
        default=0.0,
        metavar="G",
        help="free disk the checkpoints need",
    )
    g.add_argument(
        "--sizes",
        default="1,256",
        metavar="MIB,...",
        help="all-reduce sizes in MiB (default 1,256)",
    )
    g.add_argument(
        "--max-clock-skew",
        type=float,
        default=2.0,
        metavar="S",
        help="allowed clock spread (default 2 s)",
    )
    g.add_argument(
        "--expect-gbps",
        type=float,
        default=0.0,
        metavar="G",
        help="fault when the largest all-reduce's bus bandwidth is below this",
    )
    g.add_argument(
        "--timeout",
        type=whole_flag,
        default=300,
        metavar="S",
        help="give up after this long (default 300 s)",
    )
    p.set_defaults(handler=_cmd_doctor)


def _verdict(line: str, marker: str) -> "dict[str, Any] | None":
    """The report a doctor rank printed on ``line`` (after ``marker``), or None: any other line."""
    import json

    if not line.startswith(marker):
        return None
    try:
        verdict = json.loads(line[len(marker) :])
    except ValueError:
        return None
    return verdict if isinstance(verdict, dict) else None


def _cmd_doctor(args: argparse.Namespace) -> int:
    import math
    import subprocess

    from multigpu.diagnostics import DOCTOR_MARKER

    validate.positive_seconds(args.timeout, "--timeout", LaunchError)
    for flag, value in (
        ("--checkpoint-gb", args.checkpoint_gb),
        ("--max-clock-skew", args.max_clock_skew),
        ("--expect-gbps", args.expect_gbps),
    ):
        if not (math.isfinite(value) and 0 <= value <= 1e9):
            raise LaunchError(f"{flag} {value} is not a number from 0 to 1e9.", f"e.g. {flag} 2.")
    for size in args.sizes.split(","):
        try:
            ok = 0 < float(size) <= 65536
        except ValueError:
            ok = False
        if not ok:
            raise LaunchError(
                f"--sizes {args.sizes!r}: {size!r} is not a size in MiB.", "e.g. --sizes 1,256."
            )
    from multigpu.launch.flags import RunFlags

    flags = RunFlags.from_launch_args(args).replace(tee_prefix="never")
    command = flags.to_argv(
        [
            # --flag=VALUE: a value that starts with "-" (an --out of "-x") is never read as a flag there
            "-m",
            "multigpu.diagnostics.doctor",
            f"--out={args.out}",
            f"--checkpoint-gb={args.checkpoint_gb}",
            f"--sizes={args.sizes}",
            f"--max-clock-skew={args.max_clock_skew}",
            f"--expect-gbps={args.expect_gbps}",
            "--report-only",
        ]
    )
    verdicts: list[dict[str, Any]] = []

    # a thread: a stuck rank (a dead NFS mount) must not block the timeout
    def pump(stream: IO[str]) -> None:
        try:
            for line in stream:
                verdict = _verdict(line, DOCTOR_MARKER)
                if verdict is None:
                    print(line, end="", flush=True)
                else:
                    verdicts.append(verdict)
        # the pipe closed under it (doctor is stopping; its own line says so)
        except (ValueError, OSError):
            pass

    from multigpu.launch.process import launched, stopping_cleanly

    # SIGTERM too raises here: the launcher is stopped, not left running
    with stopping_cleanly() as stops:
        with launched(command, stops, read=pump, stdout=subprocess.PIPE, text=True) as proc:
            stops.release()  # (see launched)
            try:
                status = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                stops.holding = True  # (see launched)
                raise LaunchError(
                    f"doctor did not finish in {args.timeout} s (a node that never joined, or a rank "
                    "stuck on the output folder).",
                    "check that every node was started and that --out "
                    "is mounted; a lower --rdzv-timeout fails sooner.",
                ) from None
    verdict = verdicts[-1] if verdicts else None
    if verdict is None:
        if status == 0:  # another node holds rank 0: the report is printed there
            print(
                "multigpu doctor: this node's checks ran; the report is printed on the node of rank 0",
                flush=True,
            )
        return status  # non-zero: the launch itself failed, and the launcher's own line says why
    return 1 if verdict["faults"] else 0


def add_plot_parser(sub: argparse._SubParsersAction[Any]) -> None:
    plot = sub.add_parser(
        "plot",
        help="PNG loss curves of a run folder, or of every run in a queue folder",
        description="Draw train/valid loss and the validation metric against optimizer step "
        "from the metrics.csv and steps.csv files runs write (needs matplotlib).",
    )
    plot.add_argument(
        "folders", nargs="+", metavar="OUT_DIR", help="a run's out_dir, or a queue's --out folder"
    )
    plot.add_argument(
        "--out", metavar="FILE.png", help="where to write (default: curves.png in the folder given)"
    )
    plot.add_argument(
        "--metric", metavar="NAME", help="the metric for the right panel, e.g. valid_accuracy"
    )
    plot.add_argument(
        "--top",
        type=whole_flag,
        default=5,
        metavar="K",
        help="a queue folder with sweeps: also draw each "
        "sweep's K best trials and its metric against each swept value, in sweep-<family>.png (default 5)",
    )
    plot.set_defaults(handler=_cmd_plot)


def _cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multigpu.plots import find_runs, plot_runs, plot_sweep, sweep_records

    validate.count(args.top, "--top", ConfigError, high=20)
    records = [
        r for folder in args.folders if Path(folder).is_dir() for r in sweep_records(Path(folder))
    ]
    for record in records:
        drawn = plot_sweep(record, record.parent.parent / f"sweep-{record.stem}.png", args.top)
        print(
            visible(
                f"wrote {drawn} (sweep {record.stem}: its {args.top} best trials, and its metric against each "
                # a record's name comes from a file name someone else may have made
                "swept value)"
            )
        )
    try:
        runs = find_runs(args.folders)
    except ConfigError:
        if records:  # trials that report but write no metrics.csv: the sweep figure is all there is
            return 0
        raise
    out = (
        Path(args.out)
        if args.out
        else (runs[0] if len(runs) == 1 and len(args.folders) == 1 else Path(args.folders[0]))
        / "curves.png"
    )
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--out {out} does not end in .png.", "give a file name like curves.png.")
    plot_runs(runs, out, args.metric)
    names = ", ".join(visible(r.name) for r in runs[:8])
    print(
        f"wrote {visible(str(out))} ({len(runs)} run(s): {names}{', ...' if len(runs) > 8 else ''})"
    )
    return 0
