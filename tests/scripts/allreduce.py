"""All-reduce the ranks: every process must print the same sum. Used by the launcher tests.

    multigpu run --nproc 2 tests/scripts/allreduce.py
    torchrun --nproc_per_node=2 tests/scripts/allreduce.py
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import multigpu as mg

run = mg.init(timeout_s=60)
value = torch.tensor([float(run.rank + 1)], device=run.device)
if run.world_size > 1:
    dist.all_reduce(value)
record = {
    "rank": run.rank,
    "local_rank": run.local_rank,
    "world_size": run.world_size,
    "node_rank": run.world.node_rank,
    "source": run.world.source,
    "sum": value.item(),
    "backend": run.backend if run.world_size > 1 else None,
    "agent_store": run.world.agent_store,
    "master_port": run.world.master_port,
    "pid": os.getpid(),
}
out = os.environ.get("ALLREDUCE_OUT")
if out:
    with open(os.path.join(out, f"rank{run.rank}.json"), "w") as handle:
        json.dump(record, handle)
sys.stdout.write(json.dumps(record) + "\n")  # one write: lines of two ranks never interleave
sys.stdout.flush()
if len(sys.argv) > 1 and sys.argv[1] == "--fail-rank" and run.rank == int(sys.argv[2]):
    print(f"rank {run.rank} is failing on purpose", file=sys.stderr)
    sys.exit(3)
