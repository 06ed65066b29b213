"""By hand: one `multigpu run --nproc 2 tests/scripts/allreduce.py` from two source trees, interleaved,
REPEATS times each; the median wall and CPU seconds of each (docs/testing.md#stability: 9c03f1f against
a537403). OLD_SRC and NEW_SRC are `src` folders, e.g. of a `git worktree add /tmp/old <commit>`.

    .venv/bin/python benchmarks/launch_ab.py OLD_SRC NEW_SRC [REPEATS=5]
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "allreduce.py"


def launch(src: str) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "multigpu", "run", "--nproc", "2", str(SCRIPT)],
        cwd="/tmp",
        env=dict(os.environ, PYTHONPATH=src),
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        sys.exit(
            f"launch_ab: error: the launch from {src} failed. HINT: {done.stderr.strip()[-300:]}"
        )
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main(old: str, new: str, repeats: int) -> None:
    results: dict[str, list[tuple[float, float]]] = {old: [], new: []}
    for _ in range(repeats):
        for src in (old, new):
            results[src].append(launch(src))
    for src, runs in results.items():
        print(
            f"{src}: wall median {statistics.median(r[0] for r in runs):.2f} s, "
            f"CPU median {statistics.median(r[1] for r in runs):.2f} s ({repeats} launches)"
        )


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(
            "launch_ab: error: two source folders are needed. HINT: launch_ab.py OLD_SRC NEW_SRC [REPEATS]"
        )
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 5)
