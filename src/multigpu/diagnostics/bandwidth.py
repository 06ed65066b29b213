"""All-reduce smoke test and bus bandwidth: the workers of ``multigpu env --check`` (and of ``doctor``).

Why: a job that will spend days in all-reduces should first see one work on its devices and backend,
and see how fast - a slow link (a node on the wrong network interface, PCIe instead of NVLink) shows
here in seconds instead of as a slow run. Bus bandwidth follows nccl-tests: ``size x 2(n-1)/n / time``,
the bytes each rank moves in a ring all-reduce. Each size is checked for the right result too.

    multigpu run --nproc 2 -m multigpu.diagnostics.bandwidth [SIZE_MIB ...]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def measure(size_bytes: int, device: torch.device, repeats: int = 5) -> dict[str, Any]:
    """Median seconds of an all-reduce of ``size_bytes`` of float32, its bus bandwidth, and whether the sum was right."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    numel = max(1, size_bytes // 4)
    tensor = torch.full((numel,), float(rank + 1), device=device)
    expected = world * (world + 1) / 2
    times = []
    correct = True
    for attempt in range(repeats + 1):
        tensor.fill_(float(rank + 1))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if dist.is_initialized():
            dist.barrier()
        started = time.perf_counter()
        if dist.is_initialized():
            dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        correct = correct and bool(torch.all(tensor == expected).item())
        if attempt:  # the first is the warm-up (connections, buffers)
            times.append(elapsed)
    seconds = statistics.median(times)
    moved = numel * 4 * (2 * (world - 1) / world if world > 1 else 1)
    return {
        "bytes": numel * 4,
        "seconds": seconds,
        "bus_gbps": moved / seconds / 1e9,
        "correct": correct,
        "world": world,
    }


def main(argv: list[str]) -> int:
    import multigpu as mg

    sizes_mib = [float(a) for a in argv] or [1.0, 64.0]
    run = mg.init(timeout_s=120)
    # One process has nobody to exchange with: an "all-reduce" of itself measures a memory copy.
    results = (
        [
            measure(int(size * 2**20), run.comm_device if run.backend != "nccl" else run.device)
            for size in sizes_mib
        ]
        if run.world_size > 1
        else []
    )
    if run.is_main:
        print(
            "MULTIGPU_BANDWIDTH "
            + json.dumps({"backend": run.backend, "device": str(run.device), "results": results}),
            flush=True,
        )
    return 0 if all(r["correct"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
