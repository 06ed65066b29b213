"""``multigpu env``: what this machine offers, in the words a bug report needs.

Why: "DDP bugs are very challenging to replicate" (seed documents). Half of the replication is knowing
the torch build, the GPUs, the backends and what launcher the process believes it is under.
"""

from __future__ import annotations

import os
import platform
import sys

from multigpu.errors import MultiGPUError
from multigpu.world import detect_world


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
            lines.append(f"gpu {index:<9} {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                         f"capability {props.major}.{props.minor}")
        lines.append(f"bf16          {'yes' if torch.cuda.is_bf16_supported() else 'no'}")
    else:
        lines.append("gpus          none visible (CPU processes use gloo)")
    backends = [name for name in ("nccl", "gloo", "mpi") if getattr(dist, f"is_{name}_available")()]
    lines.append(f"backends      {', '.join(backends) or 'none'}")
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        lines.append(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}")
    try:
        lines.append(f"this process  {detect_world().describe()}")
    except MultiGPUError as exc:
        lines.append(f"this process  {exc}")
    return "\n".join(lines)
