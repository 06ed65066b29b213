"""``multigpu queue``: a runs file onto a pool of GPUs (or CPU slots), or as Slurm jobs."""

from __future__ import annotations

import argparse
from typing import Any

from multigpu import validate
from multigpu.commands.slurm import add_slurm_job_options, slurm_options_from_args
from multigpu.errors import ConfigError
from multigpu.launch import environment
from multigpu.validate import whole_flag

QUEUE_EXAMPLES = """\
examples:
  multigpu queue runs.yaml                      every run, one per free GPU (CPU: one per core)
  multigpu queue runs.yaml --gpus 0,1,2,3       on these GPUs only
  multigpu queue runs.yaml --only net,larger_net --max-parallel 2
  multigpu queue runs.yaml --gpus-per-run 2     every run gets 2 GPUs (DDP inside the run)
  multigpu queue runs.yaml --runs-per-gpu 4     4 small runs share each GPU (or gpus: 0.25 per run)
  multigpu queue runs.yaml --slurm --partition gpu --time 4:00:00   one Slurm job per run
  multigpu queue runs.yaml --slurm --array --max-parallel 2        one array job, 2 runs at a time
  multigpu queue runs.yaml --slurm --status                        each run's job, state, exit, metric
  multigpu queue runs.yaml --only net --sweep 'optim.lr=1e-3,3e-3,1e-2'       3 trials of net, one per lr
  multigpu queue runs.yaml --only net --sweep 'optim.lr=loguniform(1e-4,1e-1)' --samples 8

runs.yaml: keys are run names; `larger_net < net` inherits every setting of net and overrides some.
  net:
    script: examples/digits/train.py
    args: [examples/digits/hparams.yaml]
    gpus: 1
    overrides: {model.hidden: 128}
  larger_net < net:
    overrides: {model.hidden: 512}
  lr_sweep < net:                 a family: each trial is a run of net's settings plus its values
    sweep: {params: {optim.lr: [1e-3, 3e-3], model.hidden: {choice: [32, 64]}}, samples: 2}
  lr_search < net:                Optuna (pip install 'multigpu[sweep]'), bad trials pruned early
    sweep: {params: {optim.lr: {loguniform: [1e-4, 1e-1]}}}
    search: {sampler: tpe, trials: 32, metric: valid_loss, mode: min, pruner: asha}
Each run writes into OUT/<run name>/ (run.yaml, log.txt, status.json and the recipe's outputs).
Running the queue again skips finished runs and resumes interrupted ones (a search: its study too).
"""


def add_queue_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "queue",
        help="train many runs at once on a pool of GPUs (or as Slurm jobs)",
        description="Place each run of a runs file on free GPUs (CPU: process slots).",
        epilog=QUEUE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs_file")
    p.add_argument(
        "--gpus", metavar="IDS", help="the GPU pool, e.g. 0,1,2,3 (default: every visible GPU)"
    )
    p.add_argument(
        "--slots",
        type=whole_flag,
        metavar="N",
        help="N CPU process slots instead of GPUs (default on a "
        "machine without GPUs: one per core)",
    )
    p.add_argument(
        "--gpus-per-run", type=whole_flag, metavar="K", help="override every run's gpus: setting"
    )
    p.add_argument(
        "--runs-per-gpu",
        type=whole_flag,
        default=1,
        metavar="K",
        help="pack K one-GPU runs onto each GPU (CPU: each slot), each held to 1/K of the GPU's "
        "memory so a run that does not fit fails alone (default 1)",
    )
    p.add_argument(
        "--only", metavar="NAMES", help="comma-separated run names to run (in that order)"
    )
    p.add_argument("--max-parallel", type=whole_flag, metavar="M", help="at most M runs at once")
    p.add_argument(
        "--out", metavar="DIR", help="where run folders go (default: outputs/<runs file name>)"
    )
    p.add_argument(
        "--no-live", action="store_true", help="print one line per event instead of a live table"
    )
    p.add_argument(
        "--allow-env",
        action="append",
        default=[],
        metavar="NAME",
        help="let the runs file set this environment variable (beyond NCCL_*, OMP_*, HF_*, ...; repeatable)",
    )
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=VALUES",
        help="sweep an override in every chosen run: a list (optim.lr=1e-3,3e-3) or a distribution "
        "(optim.lr=loguniform(1e-4,1e-1); also choice, uniform, int); repeatable",
    )
    p.add_argument(
        "--samples",
        type=whole_flag,
        metavar="N",
        help="draws of the --sweep distributions (per grid point)",
    )
    p.add_argument(
        "--slurm", action="store_true", help="submit each run as its own Slurm job instead"
    )
    p.add_argument(
        "--array",
        action="store_true",
        help="with --slurm: all runs as one job array, each task its own "
        "run folder; --max-parallel M runs at most M at once (runs file: slurm_array: true)",
    )
    p.add_argument(
        "--status",
        action="store_true",
        help="with --slurm: show each run's job and state, submit nothing",
    )
    add_slurm_job_options(p)
    p.set_defaults(handler=_cmd_queue)


def _show_plan(specs: list[Any], searches: list[Any], out: Any, on_gpus: bool, slots: int) -> int:
    """``--dry-run`` on this machine: each run, what its folder says will happen and the command it would
    start; nothing is started, nothing written."""
    import shlex

    from multigpu.errors import visible
    from multigpu.queue.run_folder import decide

    unit = "GPU(s)" if on_gpus else "slot(s)"
    print(
        f"multigpu queue --dry-run: {len(specs)} run(s) on {slots} {unit}, folders in {visible(str(out))}; "
        "nothing started"
    )
    for spec in specs:
        folder = out / spec.name
        decision = decide(folder, spec.fingerprint())
        what = {
            "start": "would start",
            "resume": "would resume",
            "fresh": "would start afresh (settings changed)",
            "skip": "skipped",
        }[decision.action]
        after = f", after {', '.join(spec.waits_for())}" if spec.waits_for() else ""
        print(
            visible(
                f"{spec.name}: {what}{f' ({decision.note})' if decision.note else ''}, {spec.gpus:g} {unit}"
                f"{after}: {shlex.join(spec.command(folder, on_gpus))}"
            )
        )
    for search in searches:
        print(
            visible(
                f"{search.name}: a search of {search.space.search.trials} trial(s), each asked when it can "
                "start"
            )
        )
    return 0


def _cmd_queue(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multigpu.queue.plan import load_plan
    from multigpu.queue.space import parse_cli

    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else None
    allowed = [
        environment.env_name(n, ConfigError, "--allow-env: ")
        for a in args.allow_env
        for n in a.split(",")
        if n
    ]
    plan = load_plan(
        args.runs_file, only, allow_env=allowed, sweep=parse_cli(args.sweep), samples=args.samples
    )
    specs = plan.runs
    if args.gpus_per_run is not None:
        validate.count(args.gpus_per_run, "--gpus-per-run", ConfigError)
        for spec in [*specs, *(f.entry for f in plan.searches)]:
            spec.gpus = args.gpus_per_run
    if args.max_parallel is not None:
        validate.count(args.max_parallel, "--max-parallel", ConfigError)
    out = Path(args.out or Path("outputs") / Path(args.runs_file).stem)
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"--out {out} is a file, not a folder.", "give a folder for the run folders."
        )
    validate.count(
        args.runs_per_gpu, "--runs-per-gpu", ConfigError, high=validate.MAX_SHARERS_PER_GPU
    )
    if (args.array or args.status) and not args.slurm:
        flag = "--array" if args.array else "--status"
        raise ConfigError(
            f"{flag} is for Slurm jobs.",
            f"add --slurm: `multigpu queue {args.runs_file} --slurm {flag}`.",
        )
    if args.slurm:
        from multigpu.queue.slurm_jobs import show_status, submit_runs

        if args.gpus is not None or args.slots is not None:
            flag = "--gpus" if args.gpus is not None else "--slots"
            raise ConfigError(
                f"{flag} chooses this machine's GPUs or slots; Slurm jobs get theirs from the cluster.",
                "ask per node with --gpus-per-node N (or --gres gpu:N) instead.",
            )
        if args.status:
            return show_status(specs, out)
        from multigpu.queue.run_folder import finished_as

        # a run may wait only for runs already done (its folder says so, with these settings)
        for spec in specs:
            pending = [
                n for n in spec.waits_for() if not finished_as(out / n, spec.upstream.get(n))
            ]
            if pending:
                raise ConfigError(
                    f"run {spec.name!r} waits for {', '.join(pending)} (after: or {{run:NAME}}), which "
                    "is not done; Slurm jobs submitted here are not ordered yet.",
                    f"submit {', '.join(pending)} first (--only {','.join(pending)}), then this run once "
                    f"they are done (--only {spec.name}).",
                )

        packed = next((spec.name for spec in specs if spec.gpus < 1), None)
        if args.runs_per_gpu != 1 or packed:
            what = (
                f"--runs-per-gpu {args.runs_per_gpu}"
                if args.runs_per_gpu != 1
                else f"run {packed!r}'s gpus: below 1"
            )
            raise ConfigError(
                f"{what} packs runs onto shared GPUs, which Slurm jobs do not do (each gets whole GPUs).",
                "give the runs whole GPUs with --slurm, or pack them inside one job: "
                "`multigpu queue runs.yaml --runs-per-gpu K` in an sbatch script.",
            )
        options = slurm_options_from_args(args)
        if plan.searches and args.dry_run:
            raise ConfigError(
                f"run {plan.searches[0].name!r} is a search, which asks each trial's values when it can "
                "start: there is no script to write ahead.",
                "leave out --dry-run, or --only the other runs.",
            )
        code = (
            submit_runs(
                specs,
                out,
                options,
                dry_run=args.dry_run,
                array=args.array,
                max_parallel=args.max_parallel,
            )
            if specs
            else 0
        )
        if plan.searches:
            from multigpu.queue.display import console_for_output
            from multigpu.queue.search import Search
            from multigpu.queue.search_slurm import follow_searches
            from multigpu.queue.trials import summarize

            followed, runs = follow_searches(
                [Search(f.entry, f.space, out) for f in plan.searches],
                out,
                options,
                args.max_parallel,
            )
            summarize(console_for_output(), runs, out.resolve(), plan.searches)
            code = followed or code
        return code
    from multigpu.launch.devices import visible_gpus
    from multigpu.queue.display import Display, console_for_output
    from multigpu.queue.pool import plan_pool
    from multigpu.queue.scheduler import Queue
    from multigpu.queue.trials import summarize

    pool = plan_pool(visible_gpus(), gpus=args.gpus, slots=args.slots)
    if args.dry_run:
        return _show_plan(specs, plan.searches, out, pool.on_gpus, len(pool.slots))
    searches = []
    if plan.searches:
        from multigpu.queue.search import Search

        searches = [Search(f.entry, f.space, out) for f in plan.searches]
    display = Display(console_for_output(), live=False if args.no_live else None)
    queue = Queue(
        specs,
        out,
        pool.slots,
        pool.on_gpus,
        args.max_parallel,
        display,
        runs_per_gpu=args.runs_per_gpu,
        searches=searches,
    )
    code = queue.execute()
    display.summary(queue)
    summarize(display.console, queue.runs, out, plan.families)
    return code
