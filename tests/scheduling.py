"""How ``make test`` spreads the suite over its pytest-xdist workers (``-n 2 --dist loadgroup``).

Two rules, both about time on a 2-core machine:

- **A file whose tests share a launch stays on one worker.** A file that defines a fixture with
  ``scope="module"`` (or ``"session"``) starts a job once for several tests; split over two workers, each
  would start it. Every other test is a unit of its own, so a file of many slow tests (the docs pages, the
  hostile inputs) no longer keeps one worker busy while the other has finished.
- **The longest units start first** (longest-processing-time first): a 2-minute test that starts last
  makes the suite 2 minutes longer. ``tests/data/durations.json`` holds each test's duration from a
  measured run (``python tests/scheduling.py JUNIT.xml > tests/data/durations.json``); a test not in it
  counts as ``UNKNOWN_S``. A stale file only makes the order worse, never a result different.

Why not xdist's own ``xdist_group`` marks: with pytest 9.2 and pytest-xdist 3.8 they group nothing
(xdist writes the group into ``item._nodeid``, which pytest 9 no longer reads), and ``--dist loadfile``
keeps every file on one worker, the docs pages' 10 minutes included.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import OrderedDict
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
DURATIONS = TESTS / "data" / "durations.json"
UNKNOWN_S = 2.0
_SHARING = ('scope="module"', "scope='module'", 'scope="session"', "scope='session'")


def shares_a_launch(path: Path) -> bool:
    """Whether the test file defines a fixture that several of its tests share."""
    try:
        text = path.read_text()
    except OSError:
        return False
    return any(marker in text for marker in _SHARING)


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def make_scheduler(config: Any, log: Any) -> Any:
    """The scheduler of ``--dist loadgroup`` (see the module docstring)."""
    from xdist.scheduler import LoadScopeScheduling

    root = Path(config.rootpath)
    durations = load_durations()
    shared: dict[str, bool] = {}

    class SharedFilesTogether(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            if file not in shared:
                shared[file] = shares_a_launch(root / file)
            return file if shared[file] else nodeid

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the queue is complete before the first assignment
                units = sorted(self.workqueue.items(),
                               key=lambda unit: -sum(durations.get(test, UNKNOWN_S) for test in unit[1]))
                self.workqueue = OrderedDict(units)
                self.ordered = True
            super()._assign_work_unit(node)

    return SharedFilesTogether(config, log)


def durations_of(junit: Path) -> dict[str, float]:
    """Each test's setup + call + teardown time, by node id, from a ``--junitxml`` report."""
    found: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module, name = case.get("classname", ""), case.get("name", "")
        parts = module.split(".")
        classes = [p for p in parts if p[:1].isupper()]
        file = "/".join(p for p in parts if p not in classes) + ".py"
        nodeid = "::".join([file, *classes, name])
        found[nodeid] = round(found.get(nodeid, 0.0) + float(case.get("time", 0) or 0), 2)
    return dict(sorted(found.items()))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/scheduling.py JUNIT.xml > tests/data/durations.json")
    print(json.dumps(durations_of(Path(sys.argv[1])), indent=0))
