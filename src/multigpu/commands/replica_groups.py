"""``multigpu run --replica-groups R`` (and ``--replica-group G --lighthouse HOST:PORT``): the flags, checked,
handed to :mod:`multigpu.launch.replicas`.

Why apart from :mod:`~multigpu.commands.launching`: replica groups reuse every flag of ``run`` (each group
is a ``multigpu run``) and add their own five; keeping them here keeps that module about one launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from multigpu import validate
from multigpu.commands.launching import (
    _check_run_flags,
    fold_torchrun_flags,
    plan_run,
    resolve_nproc,
)
from multigpu.errors import LaunchError

if TYPE_CHECKING:
    from multigpu.launch.replicas import ReplicaSettings


def run_replica_groups(args: argparse.Namespace, quiet: Callable[[], object] = lambda: None) -> int:
    """``--replica-groups R``: the lighthouse and R groups here; with ``--replica-group G``: one group.
    ``quiet``: loads torch and lowers its C++ log level, once the flags are checked (a bad flag is one line
    in well under a second, without importing torch); one group's launch does that itself, after forking
    its workers' server (:func:`multigpu.launch.local.launch`)."""
    import dataclasses

    from multigpu.launch import replicas

    if args.replica_groups is None:
        raise LaunchError(
            "--replica-group and --lighthouse belong to a job of --replica-groups R.",
            "add --replica-groups R (the number of groups in the whole job).",
        )
    settings = replicas.ReplicaSettings(
        args.replica_groups, args.min_replicas, args.heartbeat_timeout
    ).check()
    if (args.replica_group is None) != (args.lighthouse is None):
        raise LaunchError(
            "--replica-group G and --lighthouse HOST:PORT go together (one group of a job on "
            "several machines).",
            "give both, or neither to run every group on this machine.",
        )
    if args.replica_group is not None:  # one group of a job on several machines
        validate.count(
            args.replica_group,
            "--replica-group",
            LaunchError,
            low=0,
            high=settings.groups - 1,
            hint=f"number the groups 0 to {settings.groups - 1}.",
        )
        replicas.parse_address(args.lighthouse)
        replicas.follow_launcher()
        from multigpu.launch.local import launch

        request = plan_run(args)
        env = replicas.group_env(
            args.replica_group,
            settings,
            args.lighthouse,
            loopback=request.rendezvous.endpoint.startswith(("localhost", "127.0.0.1"))
            and (args.local_addr or "127.0.0.1") == "127.0.0.1",
            verbose=args.verbose,
        )
        note = f"replica group {args.replica_group} heals from a live group while the others keep training"
        return launch(
            dataclasses.replace(
                request,
                extra_env={**request.extra_env, **env},
                restart_note=note,
                role=f"replica-group-{args.replica_group}",
            )
        )
    return _run_all_groups(args, settings, quiet)


def _run_all_groups(
    args: argparse.Namespace, settings: "ReplicaSettings", quiet: Callable[[], object]
) -> int:
    """Every group on this machine: each a ``multigpu run --replica-group g`` with its share of the GPUs."""
    from multigpu.launch import replicas
    from multigpu.launch.devices import parse_gpu_ids, visible_gpus
    from multigpu.launch.flags import RunFlags
    from multigpu.launch.local import split_command, usable_cores

    fold_torchrun_flags(args)
    clashing = {
        "--nnodes": args.nnodes not in ("1", "1:1"),
        "--node-rank": args.node_rank,
        "--master-addr": args.master_addr,
        "--master-port": args.master_port,
        "--rdzv-endpoint": args.rdzv_endpoint,
        "--simulate-nodes": args.simulate_nodes,
        "--local-addr": args.local_addr,
    }
    given = [flag for flag, value in clashing.items() if value]
    if given:
        raise LaunchError(
            f"--replica-groups runs every group on this machine; drop {given[0]}.",
            "on several machines use `multigpu slurm --replica-groups R`, or one `multigpu run "
            "--replica-groups R --replica-group G --lighthouse HOST:PORT` per machine.",
        )
    _check_run_flags(args)
    command = split_command(
        None if args.module else args.script, args.script if args.module else None, args.script_args
    )
    visible = [] if args.cpu else visible_gpus()
    nproc, cpu = resolve_nproc(args.nproc, visible, args.cpu)
    ids = parse_gpu_ids(args.gpus) if args.gpus is not None else list(range(len(visible)))
    if ids and not cpu and len(ids) % settings.groups:
        raise LaunchError(
            f"{len(ids)} GPU(s) cannot be split evenly across {settings.groups} replica groups.",
            "name a multiple of the group count with --gpus, or pass --cpu.",
        )
    per_group = len(ids) // settings.groups if ids and not cpu else 0
    if nproc is not None:
        validate.count(
            nproc * settings.groups,
            f"--replica-groups {settings.groups} x --nproc",
            LaunchError,
            hint=f"every group runs on this machine: keep the total at most {validate.MAX_PROCS_PER_NODE}.",
        )
    threads = max(1, usable_cores() // (settings.groups * (nproc or per_group or 1)))
    quiet()
    commands, envs = [], []
    with replicas.Lighthouse("127.0.0.1", 0, settings, verbose=args.verbose) as lighthouse:
        for group in range(settings.groups):
            mine = ids[group * per_group : (group + 1) * per_group]
            # every flag of this line, then the group's own
            flags = RunFlags.from_args(args).replace(
                nproc=nproc,
                gpus=",".join(map(str, mine)) if mine else None,
                cpu=cpu,
                log_dir=str(Path(args.log_dir) / f"replica-group-{group}")
                if args.log_dir
                else None,
                tee_prefix="always" if args.tee_prefix == "auto" else args.tee_prefix,
                local_addr="127.0.0.1",
                replica_groups=settings.groups,
                replica_group=group,
                min_replicas=settings.min_replicas,
                heartbeat_timeout=settings.heartbeat_timeout_s,
                lighthouse=lighthouse.address,
            )
            commands.append(flags.to_argv(command))
            envs.append(
                replicas.group_env(
                    group,
                    settings,
                    lighthouse.address,
                    loopback=True,
                    verbose=args.verbose,
                    threads=threads,
                )
            )
        return replicas.run_groups(
            commands,
            envs,
            lighthouse,
            lambda text: print(f"multigpu: {text}", file=sys.stderr, flush=True),
            grace_s=args.stop_timeout + 60,
        )
