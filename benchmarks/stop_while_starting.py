"""By hand: SIGTERM `multigpu run` the moment its fork server's folder appears, N times; count the folders
left behind (docs/testing.md#stability: 2 in 25 before 3466bc5, 0 after). The deterministic check is
tests/test_forkserver.py; this is the race as a busy machine meets it.

    .venv/bin/python benchmarks/stop_while_starting.py [N=25] [NPROC=2]
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(runs: int, nproc: str) -> int:
    work = Path(tempfile.mkdtemp(prefix="stop-while-starting-"))
    (work / "never.py").write_text("raise SystemExit(5)\n")
    leaks, codes = 0, {}
    try:
        for i in range(runs):
            temp = Path(tempfile.mkdtemp(prefix="mgt-", dir="/tmp"))
            proc = subprocess.Popen([sys.executable, "-m", "multigpu", "run", "--nproc", nproc, str(work / "never.py")],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=dict(os.environ, TMPDIR=str(temp)))
            while not list(temp.glob("multigpu-fork-*")) and proc.poll() is None:
                time.sleep(0.0005)
            time.sleep(random.choice([0, 0, 0.0002, 0.001, 0.003, 0.01]))
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
            left = [p.name for p in temp.iterdir() if p.name.startswith("multigpu-")]
            codes[proc.returncode] = codes.get(proc.returncode, 0) + 1
            if left or "Traceback" in err:
                leaks += 1
                print("left", i, proc.returncode, left, err.strip()[-300:], flush=True)
            shutil.rmtree(temp, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"runs {runs} left-behind {leaks} exit statuses {codes}")
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 25, sys.argv[2] if len(sys.argv) > 2 else "2"))
