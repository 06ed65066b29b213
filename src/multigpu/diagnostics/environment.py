"""``multigpu env``: what this machine offers, in the words a bug report needs.

Why: "DDP bugs are very challenging to replicate" (SpeechBrain's multi-GPU guide). Half of the replication is knowing
the torch build, the GPUs, the backends and what launcher the process believes it is under.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from typing import Mapping, Optional

from multigpu.distributed.world import detect_world
from multigpu.errors import MultiGPUError
from multigpu.fileio import read_regular


def report() -> str:
    import torch
    import torch.distributed as dist

    from multigpu import __version__

    lines = [
        f"multigpu      {__version__}",
        f"python        {sys.version.split()[0]} ({platform.platform()})",
        f"torch         {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})",
        f"cpus          {os.cpu_count()}",
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(
                f"gpu {index:<9} {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                f"capability {props.major}.{props.minor}"
            )
        lines.append(f"bf16          {'yes' if torch.cuda.is_bf16_supported() else 'no'}")
    else:
        lines.append("gpus          none visible (CPU processes use gloo)")
    backends = [name for name in ("nccl", "gloo", "mpi") if getattr(dist, f"is_{name}_available")()]
    lines.append(f"backends      {', '.join(backends) or 'none'}")
    lines.append(f"nccl          {_nccl_version()}")
    lines.append(f"driver        {_driver_version() or 'none (no NVIDIA driver loaded)'}")
    try:
        lines.append(f"this process  {detect_world().describe()}")
    except MultiGPUError as exc:
        lines.append(f"this process  {exc}")
    shown = relevant_variables(os.environ)
    lines.append(
        "variables     "
        + (
            "none of NCCL_*, TORCH_*, CUDA_*, *_SOCKET_IFNAME, OMP_NUM_THREADS set"
            if not shown
            else f"{len(shown)} set that change distributed behaviour:"
        )
    )
    lines += [f"  {name}={value}" for name, value in shown]
    lines += _collect_env_summary()
    return "\n".join(lines)


_VARIABLE = re.compile(
    r"^(NCCL_|TORCH_|CUDA_|PYTORCH_|GLOO_|MASTER_|OMP_NUM_THREADS$|SLURM_JOB_ID$|"
    r"[A-Z0-9_]*_SOCKET_IFNAME$)"
)


def relevant_variables(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The environment variables that change how torch.distributed, NCCL or gloo behave, sorted."""
    return sorted(
        (k, v if len(v) <= 200 else v[:200] + "...")
        for k, v in environ.items()
        if _VARIABLE.match(k)
    )


def _nccl_version() -> str:
    import torch

    if not torch.distributed.is_nccl_available() or not torch.version.cuda:
        return "none in this torch build (CPU build: gloo only)"
    try:
        version = torch.cuda.nccl.version()
        return (
            ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)
        )
    except Exception as exc:  # a CUDA build without a usable libnccl
        return f"unknown ({type(exc).__name__})"


def _driver_version() -> Optional[str]:
    """The NVIDIA kernel driver's version, from /proc (no subprocess, no CUDA initialisation)."""
    try:
        first = (
            read_regular("/proc/driver/nvidia/version", 4096)
            .decode(errors="replace")
            .split("\n", 1)[0]
        )
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for \S+)?\s+([0-9.]+)", first)
    return found.group(1) if found else first.strip()[:120] or None


def _collect_env_summary() -> list[str]:
    """The lines of ``torch.utils.collect_env`` a bug report needs (the whole report: python -m torch.utils.collect_env)."""
    try:
        from torch.utils import collect_env

        info = collect_env.get_env_info()
    # it shells out to pip, nvidia-smi, gcc: any of them may be missing or broken
    except Exception as exc:
        return [
            f"collect_env   failed ({type(exc).__name__}); run python -m torch.utils.collect_env"
        ]
    packages = [
        line
        for line in (info.pip_packages or "").splitlines()
        if re.match(
            r"(torch|numpy|lightning|pytorch-lightning|accelerate|nvidia-nccl|triton)\b", line
        )
    ]
    fields = (
        ("os", info.os),
        ("libc", info.libc_version),
        ("gcc", info.gcc_version),
        ("cuda runtime", info.cuda_runtime_version),
        ("cudnn", info.cudnn_version),
        ("gpu models", " ".join(str(info.nvidia_gpu_models or "").split())),
        ("packages", ", ".join(packages)),
    )
    lines = [
        "collect_env   (torch.utils.collect_env; the full report: python -m torch.utils.collect_env)"
    ]
    lines += [
        f"  {name:<13}{value}"
        for name, value in fields
        if value not in (None, "", "N/A", "Could not collect")
    ]
    return lines


def check(
    nproc: Optional[int],
    gpus: Optional[str],
    cpu: bool,
    sizes_mib: tuple[float, ...] = (1.0, 64.0),
    timeout_s: float = 300.0,
) -> tuple[bool, list[str]]:
    """``multigpu env --check``: an all-reduce on the chosen devices through ``multigpu run``; lines to print.

    Runs the real launcher (the same rendezvous, backend and devices as a training job would get), so
    a failure here is the failure the job would meet, in seconds instead of at step one of a queue slot.
    """
    from multigpu.errors import LaunchError
    from multigpu.launch.flags import RunFlags

    command = RunFlags(nproc=nproc, gpus=gpus, cpu=cpu, tee_prefix="never").to_argv(
        ["-m", "multigpu.diagnostics.bandwidth", *(str(s) for s in sizes_mib)]
    )
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"the all-reduce check did not finish in {timeout_s:.0f} s.",
            "run `multigpu run --debug -m multigpu.diagnostics.bandwidth` to see where it hangs.",
        ) from None
    found = [line for line in proc.stdout.splitlines() if line.startswith("MULTIGPU_BANDWIDTH ")]
    if not found:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
        return False, [
            "all-reduce check FAILED (status {}):".format(proc.returncode),
            *(f"  {t}" for t in tail),
        ]
    result = json.loads(found[-1].split(" ", 1)[1])
    if not result["results"]:
        return proc.returncode == 0, [
            f"all-reduce: one process on {result['device']}: nothing to measure (an "
            "all-reduce needs two ranks; use --nproc 2, or --gpus with two GPUs)"
        ]
    lines = []
    for item in result["results"]:
        verdict = "ok" if item["correct"] else "WRONG SUM"
        lines.append(
            f"all-reduce {item['bytes'] / 2**20:7.1f} MiB on {item['world']} process(es) "
            f"({result['backend']}, {result['device'].split(':')[0]}): {item['seconds'] * 1e3:8.2f} ms, "
            f"bus bandwidth {item['bus_gbps']:.2f} GB/s  {verdict}"
        )
    return proc.returncode == 0 and all(i["correct"] for i in result["results"]), lines
