"""How long the docs tests take: the page tests of tests/test_docs.py (every block run), in all and per page.

    python benchmarks/docs_tests.py

The docs tests run every command of README.md and docs/ (tests/docs_runner.py); their time is part of
the suite's budget, so docs/testing.md quotes it from here.
"""

import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from record import record

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_docs.py", "-q", "-p", "no:cacheprovider",
                           "-k", "every_block_of_the_page", "--durations=0"], cwd=ROOT, env=env, capture_output=True, text=True)
    total = time.perf_counter() - started
    print(proc.stdout[-3000:])
    if proc.returncode != 0:
        sys.exit(f"the docs tests failed (exit {proc.returncode}); nothing recorded")
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU time of every process the tests started and waited for: what the wall time would shrink to
    # on idle cores (divided by their number), independent of the machine's load.
    figures = {"total_s": total, "cpu_s": used.ru_utime + used.ru_stime}
    for seconds, page in re.findall(r"^([\d.]+)s call\s+"
                                    r"tests/test_docs.py::test_every_block_of_the_page_runs_as_written\[(.+?)\]",
                                    proc.stdout, re.M):
        figures[Path(page).stem.lower().replace("-", "_") + "_s"] = float(seconds)
    figures["passed"] = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    record("docs_tests", figures, [__file__])


if __name__ == "__main__":
    main()
