"""``multigpu doctor``: a pre-flight of the machines a job will run on, in under a minute.

Why: a 3-day job that dies at hour 2 because one node has another torch, a clock an hour off, an
output folder that is not really shared, a full disk or a GPU another process holds, costs a day of
queueing and the work in between. Each of these is cheap to see before the job starts, from inside
the same launch the job will use (the same rendezvous, backend and devices), so a rendezvous that
cannot form fails here, in seconds, with the launcher's one line.

This module is the worker, run on every rank by ``multigpu doctor`` through ``multigpu run``:

    multigpu run [node flags] -m multigpu.diagnostics.doctor --out DIR [--checkpoint-gb G] [--sizes 1,256]
    multigpu slurm --nodes 2 --gpus-per-node 4 --time 5:00 -m multigpu.diagnostics.doctor --out /shared/x

Every rank gathers its facts, rank 0 compares them, runs the all-reduces and prints a table, the
first fault as one line with a HINT, and a ``MULTIGPU_DOCTOR {json}`` line the command reads.
Every rank exits 1 when there is a fault (so a Slurm job of it ends FAILED), unless ``--report-only``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from multigpu import validate
from multigpu.diagnostics import DOCTOR_MARKER
from multigpu.diagnostics.bandwidth import measure
from multigpu.fileio import Folder


def existing(out: Path) -> Path:
    """``out``, or its nearest existing parent: where a run would create it. Doctor creates nothing."""
    while not out.exists() and out.parent != out:
        out = out.parent
    return out


def local_facts(out: Path) -> dict[str, Any]:
    """What this rank sees: versions, its host, the output folder (or where it would be created), its GPU."""
    import multigpu

    facts: dict[str, Any] = {
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "multigpu": multigpu.__version__,
        "nccl": "none",
    }
    if torch.cuda.is_available() and dist.is_nccl_available():
        try:
            version = torch.cuda.nccl.version()
            facts["nccl"] = (
                ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
            )
        # a CUDA build without a usable libnccl: the all-reduce below will say more
        except Exception:
            facts["nccl"] = "unknown"
    try:
        probe = f".multigpu-doctor-write-{socket.gethostname()[:60]}-{os.getpid()}"
        Folder(existing(out)).write_atomic(probe, b"x")
        Folder(existing(out)).remove(probe)
        facts["writable"] = True
    except OSError as exc:
        facts["writable"] = False
        facts["write_error"] = f"{exc.strerror or exc}"
    try:
        facts["free_gb"] = shutil.disk_usage(existing(out)).free / 1e9
    except OSError:
        facts["free_gb"] = None
    if (
        torch.cuda.is_available()
        and validate.whole_number(os.environ.get("LOCAL_RANK", "0"), "LOCAL_RANK") == 0
    ):
        facts["ecc"] = ecc_errors()  # once per node
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(device)
        facts["gpu"] = {
            "name": torch.cuda.get_device_name(device),
            "free_gb": free / 1e9,
            "total_gb": total / 1e9,
        }
    return facts


def ecc_errors() -> Optional[dict[str, str]]:
    """Uncorrected ECC errors per visible GPU since the driver loaded, from ``nvidia-smi`` (None: no
    nvidia-smi here). A GPU with uncorrected errors computes wrong numbers or dies mid-job."""
    if shutil.which("nvidia-smi") is None:
        return None
    import subprocess

    try:
        done = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,ecc.errors.uncorrected.volatile.total",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = {}
    for line in done.stdout.splitlines():
        index, _, count = line.partition(",")
        if index.strip():
            found[index.strip()] = count.strip()
    return found


def _shared_folder(out: Path, run: Any, writable: bool) -> Optional[bool]:
    """Rank 0 writes a file with a fresh secret into ``out``; every rank must read that same secret.
    Every rank takes part in the same collectives, writable or not (else the ranks would disagree on
    which collective comes next and hang - on exactly the node this should report). None with one
    process: there is nobody to share with."""
    if run.world_size == 1:
        return None
    folder = Folder(existing(out))
    secret = secrets.token_hex(8) if run.is_main else ""
    name = [f".multigpu-doctor-shared-{secret}"]
    if run.is_main and writable:
        with contextlib.suppress(OSError):
            folder.write_atomic(name[0], secret)
    dist.broadcast_object_list(name, src=0)
    dist.barrier()
    try:
        seen = writable and folder.load_text(name[0], limit=64) == name[0].rsplit("-", 1)[1]
    except OSError:
        seen = False
    dist.barrier()
    if run.is_main and writable:
        with contextlib.suppress(OSError):
            folder.remove(name[0])
    return seen


def faults(
    facts: list[dict[str, Any]], args: argparse.Namespace, results: list[dict[str, Any]]
) -> list[tuple[str, str]]:
    """(problem, hint) in the order a person should fix them."""
    found: list[tuple[str, str]] = []
    for key in ("multigpu", "torch", "cuda", "nccl", "python"):
        values: dict[Any, list[str]] = {}
        for rank, fact in enumerate(facts):
            values.setdefault(fact[key], []).append(f"{fact['host']} (rank {rank})")
        if len(values) > 1:
            shown = "; ".join(
                f"{version} on {', '.join(where[:3])}" for version, where in values.items()
            )
            found.append(
                (
                    f"{key} versions differ: {shown}",
                    "install the same versions on every node (the same container image or environment).",
                )
            )
    stamps = [fact["clock"] for fact in facts]
    skew = max(stamps) - min(stamps)
    if skew > args.max_clock_skew:
        late = facts[stamps.index(max(stamps))]["host"]
        found.append(
            (
                f"clocks differ by {skew:.1f} s (ahead: {late}; bound {args.max_clock_skew:g} s)",
                "run NTP/chrony on every node: timestamps in logs, checkpoints and Slurm's limits rely on them.",
            )
        )
    for rank, fact in enumerate(facts):
        if not fact["writable"]:
            found.append(
                (
                    f"{args.out} is not writable on {fact['host']} (rank {rank}): {fact.get('write_error')}",
                    "give --out a folder every node may write (checkpoints go there).",
                )
            )
            break
    for rank, fact in enumerate(facts):
        if fact["writable"] and fact["shared"] is False:
            found.append(
                (
                    f"{args.out} is not shared: a file written by rank 0 on {facts[0]['host']} is not there "
                    f"on {fact['host']} (rank {rank})",
                    "put the output folder on the shared file system (checkpoints are written by rank 0 and "
                    "read by every rank on resume).",
                )
            )
            break
    if args.checkpoint_gb:
        for _rank, fact in enumerate(facts):
            if fact.get("free_gb") is not None and fact["free_gb"] < args.checkpoint_gb:
                found.append(
                    (
                        f"{fact['free_gb']:.1f} GB free at {args.out} on {fact['host']}, the checkpoints "
                        f"need {args.checkpoint_gb:g} GB",
                        "free space, or lower keep_last.",
                    )
                )
                break
    for rank, fact in enumerate(facts):
        gpu = fact.get("gpu")
        if gpu and gpu["free_gb"] < 0.9 * gpu["total_gb"] - 1.0:
            found.append(
                (
                    f"the GPU of rank {rank} on {fact['host']} has only {gpu['free_gb']:.1f} of "
                    f"{gpu['total_gb']:.1f} GB free: another process holds it",
                    "find it with nvidia-smi; a job sharing a GPU runs slowly or out of memory.",
                )
            )
            break
    for fact in facts:
        bad = {
            gpu: count
            for gpu, count in (fact.get("ecc") or {}).items()
            if validate.is_digits(count) and int(count) > 0
        }
        if bad:
            found.append(
                (
                    f"uncorrected ECC errors on {fact['host']}: "
                    + ", ".join(f"GPU {g}: {c}" for g, c in bad.items()),
                    "drain the node (or leave those GPUs out with --gpus) and tell its administrators.",
                )
            )
            break
    for result in results:
        if not result["correct"]:
            found.append(
                (
                    f"an all-reduce of {result['bytes'] / 2**20:.0f} MiB gave a wrong sum",
                    "check the GPUs and the interconnect (nvidia-smi -q for ECC and XID errors).",
                )
            )
            break
    if args.expect_gbps:
        slow = [r for r in results if r["bytes"] >= 64 * 2**20 and r["bus_gbps"] < args.expect_gbps]
        if slow:
            found.append(
                (
                    f"all-reduce bus bandwidth {slow[0]['bus_gbps']:.2f} GB/s is below the expected "
                    f"{args.expect_gbps:g} GB/s",
                    "check NCCL_SOCKET_IFNAME / the InfiniBand setup with "
                    "`multigpu run --debug` (NCCL_DEBUG=INFO shows the transport).",
                )
            )
    return found


def _shared_row(facts: list[dict[str, Any]]) -> tuple[str, str, str]:
    if len(facts) == 1:
        return ("shared", "-", "skipped: one process has nobody to share the folder with")
    seen = sum(bool(f["shared"]) for f in facts)
    if seen == len(facts):
        return ("shared", "ok", "rank 0's file seen by every rank")
    return ("shared", "NOT SHARED", f"seen by {seen} of {len(facts)} ranks")


def _ecc_row(facts: list[dict[str, Any]]) -> tuple[str, str, str]:
    seen = [fact["ecc"] for fact in facts if fact.get("ecc") is not None]
    if not seen:
        return (
            "ecc",
            "-",
            "not checked: no nvidia-smi on the nodes (XID errors: the kernel log, dmesg)",
        )
    bad = sum(
        1 for ecc in seen for count in ecc.values() if validate.is_digits(count) and int(count) > 0
    )
    return (
        "ecc",
        "ok" if not bad else "ERRORS",
        f"uncorrected errors on {bad} GPU(s) of {sum(map(len, seen))}; "
        "XID errors are not read (kernel log, dmesg)",
    )


def main(argv: Optional[list[str]] = None) -> int:
    import multigpu as mg

    parser = argparse.ArgumentParser(prog="multigpu.diagnostics.doctor")
    parser.add_argument("--out", default=".")
    parser.add_argument("--checkpoint-gb", type=float, default=0.0)
    parser.add_argument("--sizes", default="1,256")
    parser.add_argument("--max-clock-skew", type=float, default=2.0)
    parser.add_argument("--expect-gbps", type=float, default=0.0)
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="exit 0 even with faults (`multigpu doctor` reads the verdict line instead)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    run = mg.init(timeout_s=60)
    started = time.monotonic()
    fact = local_facts(out)
    fact["shared"] = _shared_folder(out, run, fact["writable"])
    run.barrier()
    fact["clock"] = time.time()
    facts: list[dict[str, Any]] = [fact]
    if run.world_size > 1:
        facts = [{} for _ in range(run.world_size)]
        dist.all_gather_object(facts, fact)
    device = run.device if run.backend == "nccl" else run.comm_device
    # One process has nobody to exchange with: its "all-reduce" would time a memory copy.
    results = (
        [
            measure(int(float(size) * 2**20), device, repeats=3)
            for size in args.sizes.split(",")
            if size
        ]
        if run.world_size > 1
        else []
    )
    # every rank has the same facts: every rank reaches the same verdict
    found = faults(facts, args, results)
    status = 0 if args.report_only or not found else 1
    if not run.is_main:
        return status
    hosts = sorted({f["host"] for f in facts})
    print(
        f"multigpu doctor: {run.world_size} rank(s) on {len(hosts)} node(s) ({', '.join(hosts[:4])}"
        f"{', ...' if len(hosts) > 4 else ''}), backend {run.backend}"
    )
    first = facts[0]
    rows = [
        ("rendezvous", "ok", f"{run.world_size} ranks joined"),
        *[
            (
                key,
                "ok" if len({f[key] for f in facts}) == 1 else "DIFFER",
                ", ".join(sorted({str(f[key]) for f in facts})),
            )
            for key in ("multigpu", "torch", "cuda", "nccl", "python")
        ],
        (
            "clocks",
            "ok"
            if max(f["clock"] for f in facts) - min(f["clock"] for f in facts)
            <= args.max_clock_skew
            else "SKEW",
            f"spread {max(f['clock'] for f in facts) - min(f['clock'] for f in facts):.2f} s",
        ),
        (
            "output folder",
            "ok" if all(f["writable"] for f in facts) else "NOT WRITABLE",
            str(out)
            if out.exists()
            else f"{out} (does not exist yet: checked {existing(out)}, where it would be created)",
        ),
        _shared_row(facts),
        (
            "free disk",
            "ok"
            if not args.checkpoint_gb
            or min((f["free_gb"] or 0) for f in facts) >= args.checkpoint_gb
            else "LOW",
            f"{min((f['free_gb'] or 0) for f in facts):.1f} GB at least",
        ),
        (
            "gpus",
            "ok" if "gpu" in first or run.backend != "nccl" else "?",
            first["gpu"]["name"] if "gpu" in first else "none (CPU, gloo)",
        ),
        _ecc_row(facts),
    ]
    if not results:
        rows.append(("all-reduce", "-", "skipped: one process has nobody to exchange with"))
    for result in results:
        rows.append(
            (
                f"all-reduce {result['bytes'] / 2**20:.0f} MiB",
                "ok" if result["correct"] else "WRONG",
                f"{result['seconds'] * 1e3:.1f} ms, bus {result['bus_gbps']:.2f} GB/s",
            )
        )
    for name, verdict, detail in rows:
        print(f"  {name:<18} {verdict:<12} {detail}")
    print(f"  ({time.monotonic() - started:.1f} s)")
    if found:
        problem, hint = found[0]
        print(f"multigpu: error: {problem}. HINT: {hint}", file=sys.stderr, flush=True)
        for problem, _hint in found[1:]:
            print(f"  also: {problem}", file=sys.stderr)
    print(
        DOCTOR_MARKER + json.dumps({"faults": [p for p, _ in found], "world": run.world_size}),
        flush=True,
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
