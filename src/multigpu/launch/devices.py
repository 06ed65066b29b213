"""Which devices each launched process gets: ``--gpus``, ``--nproc``, ``--gpus-per-proc``,
``--procs-per-gpu``, ``--cpu``.

Pure functions over the list of visible GPUs, so every rule (and every error) is unit-tested without a
GPU. ``--gpus`` indexes the GPUs this shell can see (what ``nvidia-smi`` lists when
CUDA_VISIBLE_DEVICES is unset), like ``computing.gpu_ids`` in ASDF's multi-GPU guide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from multigpu import validate
from multigpu.errors import LaunchError


@dataclass(frozen=True)
class DevicePlan:
    nproc: int
    #: CUDA_VISIBLE_DEVICES for the children; "" hides every GPU; None leaves the variable alone.
    visible: Optional[str]
    gpus_per_proc: int = 1
    #: Processes sharing each GPU (``--procs-per-gpu``): they talk over gloo, since NCCL refuses two
    #: ranks on one GPU. For tests of the multi-process CUDA path on a one-GPU machine, and small models.
    procs_per_gpu: int = 1

    def describe(self) -> str:
        if not self.visible:
            return f"{self.nproc} CPU process(es)"
        per = f", {self.gpus_per_proc} GPUs each" if self.gpus_per_proc > 1 else ""
        per += f", {self.procs_per_gpu} processes per GPU" if self.procs_per_gpu > 1 else ""
        return f"{self.nproc} process(es) on GPU(s) {self.visible}{per}"


def no_gpu_here() -> bool:
    """No GPU driver on this machine, or every GPU hidden (``CUDA_VISIBLE_DEVICES`` empty): known without
    importing torch. False means "maybe": :func:`visible_gpus` asks torch."""
    if not any(
        os.path.exists(p) for p in ("/proc/driver/nvidia/gpus", "/dev/kfd", "/dev/nvidiactl")
    ):
        return True
    return os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() == ""


def visible_gpus() -> list[str]:
    """The GPU ids this shell can see, as CUDA_VISIBLE_DEVICES names them (or 0..N-1 when unset).

    On a machine without an NVIDIA or AMD driver, or with ``CUDA_VISIBLE_DEVICES`` empty, this answers
    without importing torch (~2 s), so commands that only need to know "no GPU here" stay fast, and a CPU
    launch can still fork its workers (:func:`multigpu.launch.local.launch`).
    """
    if no_gpu_here():
        return []
    import torch

    count = torch.cuda.device_count()
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return [str(i) for i in range(count)]
    ids = [part.strip() for part in raw.split(",") if part.strip()]
    return ids[:count]


def parse_gpu_ids(text: str) -> list[int]:
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if (
            not validate.is_digits(lo)
            or (sep and not validate.is_digits(hi))
            or len(lo) > 4
            or len(hi) > 4
        ):
            raise LaunchError(
                f"--gpus {text[:40]!r}: {part[:20]!r} is not a GPU index.",
                "write --gpus 0,2,3 or --gpus 0-3.",
            )
        if sep and int(hi) < int(lo):
            raise LaunchError(
                f"--gpus {text[:40]!r}: the range {part!r} runs backwards.", "write --gpus 0-3."
            )
        ids.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
        if len(ids) > validate.MAX_PROCS_PER_NODE:
            raise LaunchError(
                f"--gpus {text[:40]!r} names more than {validate.MAX_PROCS_PER_NODE} GPUs.",
                "list the GPUs of this machine (`nvidia-smi -L`).",
            )
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise LaunchError(
            f"--gpus {text!r} names GPU {duplicates[0]} twice.", "list each GPU once."
        )
    return ids


def plan_devices(
    visible_gpus: Sequence[str],
    gpus: Optional[str] = None,
    nproc: Optional[int] = None,
    gpus_per_proc: int = 1,
    cpu: bool = False,
    procs_per_gpu: int = 1,
) -> DevicePlan:
    """Decide processes and CUDA_VISIBLE_DEVICES. ``visible_gpus`` are the ids this shell can see."""
    validate.count(gpus_per_proc, "--gpus-per-proc", LaunchError)
    validate.count(
        procs_per_gpu,
        "--procs-per-gpu",
        LaunchError,
        high=validate.MAX_SHARERS_PER_GPU,
        hint=f"use 1 to {validate.MAX_SHARERS_PER_GPU}: each process holds a CUDA context on the GPU.",
    )
    if nproc is not None:
        validate.count(nproc, "--nproc", LaunchError)
    if procs_per_gpu > 1:
        return _shared_gpus(visible_gpus, gpus, nproc, gpus_per_proc, cpu, procs_per_gpu)
    if cpu:
        if gpus is not None:
            raise LaunchError("--cpu and --gpus contradict each other.", "drop one of them.")
        return DevicePlan(nproc=nproc or 1, visible="", gpus_per_proc=1)
    if gpus is not None:
        ids = parse_gpu_ids(gpus)
        if not visible_gpus:
            raise LaunchError(
                f"--gpus {gpus} was given but no GPU is visible.",
                "use CPU processes instead: --nproc N with `run`, --slots N with `queue`.",
            )
        bad = [i for i in ids if i >= len(visible_gpus)]
        if bad:
            raise LaunchError(
                f"--gpus {gpus}: GPU {bad[0]} does not exist; {len(visible_gpus)} GPU(s) are visible "
                f"(0-{len(visible_gpus) - 1}).",
                "choose ids from `nvidia-smi -L` (or `multigpu env`).",
            )
        chosen = [visible_gpus[i] for i in ids]
    elif visible_gpus:
        wanted = (nproc or len(visible_gpus) // gpus_per_proc) * gpus_per_proc
        if wanted == 0 or wanted > len(visible_gpus):
            raise LaunchError(
                f"{nproc or 1} process(es) x {gpus_per_proc} GPU(s) each need {max(wanted, gpus_per_proc)} GPUs "
                f"but {len(visible_gpus)} are visible.",
                "lower --nproc or --gpus-per-proc, or pass --cpu to run CPU processes.",
            )
        chosen = list(visible_gpus[:wanted])
    else:
        if gpus_per_proc > 1:
            raise LaunchError(
                f"--gpus-per-proc {gpus_per_proc} needs GPUs but none is visible.",
                "drop --gpus-per-proc on a CPU machine (each CPU process uses the CPU).",
            )
        return DevicePlan(nproc=nproc or 1, visible=None, gpus_per_proc=1)
    if len(chosen) % gpus_per_proc:
        raise LaunchError(
            f"{len(chosen)} GPU(s) cannot be split into processes of {gpus_per_proc} GPUs each.",
            f"give a multiple of {gpus_per_proc} GPUs to --gpus, or change --gpus-per-proc.",
        )
    count = len(chosen) // gpus_per_proc
    if nproc is not None and nproc != count:
        raise LaunchError(
            f"--nproc {nproc} contradicts --gpus {gpus} ({count} process(es) of {gpus_per_proc} GPU(s)).",
            "give only --gpus; the number of processes follows from it.",
        )
    return DevicePlan(nproc=count, visible=",".join(chosen), gpus_per_proc=gpus_per_proc)


def _shared_gpus(
    visible_gpus: Sequence[str],
    gpus: Optional[str],
    nproc: Optional[int],
    gpus_per_proc: int,
    cpu: bool,
    procs_per_gpu: int,
) -> DevicePlan:
    """``--procs-per-gpu K``: K processes on each chosen GPU (every visible one unless --gpus or --nproc)."""
    k = procs_per_gpu
    if cpu or gpus_per_proc > 1:
        other = "--cpu" if cpu else "--gpus-per-proc"
        raise LaunchError(
            f"--procs-per-gpu {k} and {other} contradict each other.",
            "--procs-per-gpu puts several processes on one GPU; drop one of the two flags.",
        )
    if not visible_gpus:
        raise LaunchError(
            f"--procs-per-gpu {k} needs a GPU but none is visible.",
            "on a CPU machine use --nproc N alone (each CPU process uses the CPU).",
        )
    if nproc is not None and nproc % k:
        raise LaunchError(
            f"--nproc {nproc} is not a multiple of --procs-per-gpu {k}.",
            f"give --nproc {k * max(1, nproc // k)}, or only --gpus (processes = GPUs x {k}).",
        )
    if gpus is not None:
        base = plan_devices(visible_gpus, gpus=gpus)
    else:
        count = nproc // k if nproc is not None else len(visible_gpus)
        if count > len(visible_gpus):
            raise LaunchError(
                f"--nproc {nproc} at {k} per GPU needs {count} GPUs but {len(visible_gpus)} are visible.",
                "lower --nproc, or raise --procs-per-gpu.",
            )
        base = DevicePlan(nproc=count, visible=",".join(visible_gpus[:count]))
    if nproc is not None and nproc != base.nproc * k:
        raise LaunchError(
            f"--nproc {nproc} contradicts --gpus {gpus} at --procs-per-gpu {k} ({base.nproc * k} processes).",
            "give only --gpus; the number of processes follows from it.",
        )
    validate.count(
        base.nproc * k, "--procs-per-gpu x GPUs", LaunchError, high=validate.MAX_PROCS_PER_NODE
    )
    return DevicePlan(nproc=base.nproc * k, visible=base.visible, procs_per_gpu=k)
