"""Where a benchmark's figures go: ``benchmarks/results/<name>.json``.

The docs quote figures from these files only (a marker before each number, ``<!-- figure: NAME.KEY -->``),
and tests/test_docs.py checks each printed number against its file. A file holds the date, the Python and
torch versions, the machine, the exact command, and the SHA-256 of the benchmark's own files: when a
benchmark changes, the hash no longer matches and the test asks for a new measurement - a figure never
outlives the code that measured it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def files_hash(files: Iterable[str]) -> str:
    """SHA-256 over the files (paths relative to the repository) and their names: the same function as
    tests/docs_checks.py's."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + (REPO / name).read_bytes() + b"\0")
    return digest.hexdigest()


def record(name: str, figures: dict[str, Any], files: Iterable[str], notes: str = "") -> Path:
    """Write ``benchmarks/results/<name>.json`` and say so. ``files``: the benchmark's own files (its
    script and workers), relative to the repository."""
    import torch

    files = sorted(str(Path(f).resolve().relative_to(REPO)) for f in files)
    data = {
        "benchmark": name,
        "date": datetime.date.today().isoformat(),
        "command": "python "
        + shlex.join([str(Path(sys.argv[0]).resolve().relative_to(REPO)), *sys.argv[1:]]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s), {platform.system()} {platform.release()}",
        "load_average_at_end": round(os.getloadavg()[0], 2),
        "files": files,
        "sha256": files_hash(files),
        "notes": notes,
        "figures": figures,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"figures written to {path.relative_to(REPO)}")
    return path
