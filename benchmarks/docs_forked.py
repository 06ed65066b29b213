"""What the docs tests would save if each ``multigpu ...`` line of the pages were forked from a process that
imported torch, rather than started as a user's shell starts it (a new interpreter per command).

    python benchmarks/docs_forked.py [PAGE.md ...]      # every page with runnable blocks by default

Why: the suite's budget is 15 minutes on 2 cores, and docs/testing.md ("How long it takes") asks whether
forking the commands the tests start would reach it. Each page runs twice, in two sandboxes of
tests/docs_runner.py, interleaved a unit at a time (so that the machine's load falls on both alike):
(A) as tests/test_docs.py runs it, each line through ``bash -c`` (a block with a loop, a here-document, a
continued line or a background job runs whole); (B) each line that is a plain ``multigpu ...`` command
(no shell operator) forked from tests/scripts/case_server.py ``--launches``, started with that sandbox's
environment (the conftest's launch server), every other line as in (A). The figures are CPU seconds of
every process each side started (this process is their subreaper, the server theirs), not wall time,
so that a loaded machine changes them little.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from record import record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import docs_runner  # noqa: E402 - the tests' own runner: the same sandbox and blocks

SERVER = ROOT / "tests" / "scripts" / "case_server.py"
HZ = os.sysconf("SC_CLK_TCK")
COMPOUND = ("\\\n", "<<", "do\n", "then\n", "{\n", "(\n")


def children_cpu() -> float:
    """CPU seconds of this process's children that ended, orphans included (reaped here first)."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def process_cpu(pid: int) -> float:
    """A live process's CPU seconds with its reaped children's (utime, stime, cutime, cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / HZ


def units(page: Path) -> Iterator[tuple[docs_runner.Block, str, str]]:
    """(block, kind, source): a Python block whole, a bash block a line at a time (whole if compound)."""
    for block in docs_runner.blocks(page):
        if not docs_runner.runnable(block):
            continue
        if block.lang == "python":
            yield block, "python", block.source
        elif any(t in block.source for t in COMPOUND) or "&" in block.source.replace("&&", ""):
            yield block, "bash", block.source
        else:
            for line in block.source.splitlines():
                if line.strip() and not line.strip().startswith("#"):
                    yield block, "bash", line


def forkable(kind: str, source: str) -> list[str] | None:
    """The argv after ``multigpu`` of a plain one-command line, else None."""
    words = source.split("#")[0].strip()
    if kind != "bash" or not words.startswith("multigpu ") or any(c in words for c in "|;&><$`\n"):
        return None
    return shlex.split(words)[1:]


class Server:
    """tests/scripts/case_server.py --launches in a sandbox, with its environment."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env = root, env
        self.proc = subprocess.Popen([sys.executable, str(SERVER), "--launches"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=root)
        self.request(["--version"])
        self.started_cpu = process_cpu(self.proc.pid)

    def request(self, argv: list[str]) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"id": 1, "argv": argv, "cwd": str(self.root), "env": self.env,
                                          "out": str(self.root / ".out"), "err": str(self.root / ".err"),
                                          "timeout": docs_runner.BLOCK_TIMEOUT_S, "launch": True}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def shell(kind: str, source: str, root: Path, env: dict[str, str]) -> tuple[float, int]:
    if kind == "python":
        (root / ".unit.py").write_text(source)
        command = [sys.executable, ".unit.py"]
    else:
        command = ["bash", "-c", "set -euo pipefail\n" + source]
    before = children_cpu()
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                          timeout=docs_runner.BLOCK_TIMEOUT_S)
    return children_cpu() - before, proc.returncode


def measure(page: Path) -> dict[str, float]:
    fresh = forked = 0.0
    lines = forked_lines = 0
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        root_a, root_b = Path(a), Path(b)
        env_a, env_b = docs_runner.make_sandbox(root_a), docs_runner.make_sandbox(root_b)
        server = Server(root_b, env_b)
        try:
            for block, kind, source in units(page):
                cpu_a, status_a = shell(kind, source, root_a, env_a)
                argv = forkable(kind, source)
                if argv is None:
                    cpu_b, status_b = shell(kind, source, root_b, env_b)
                else:
                    before = process_cpu(server.proc.pid)
                    reply = server.request(argv)
                    cpu_b, status_b = process_cpu(server.proc.pid) - before, reply["status"]
                    forked_lines += 1
                if status_a != 0 or status_b != 0:
                    sys.exit(f"{block.where}: exit {status_a} (A) and {status_b} (B); nothing recorded")
                lines += 1
                fresh += cpu_a
                forked += cpu_b
                print(f"{cpu_a:6.1f} s {cpu_b:6.1f} s  {'forked' if argv else 'as A  '}  {block.where}  "
                      f"{source.splitlines()[0][:70]}", flush=True)
        finally:
            server.close()
    print(f"== {page.name}: A {fresh:.1f} s, B {forked:.1f} s and its server {server.started_cpu:.1f} s", flush=True)
    return {"fresh_cpu_s": fresh, "forked_cpu_s": forked, "server_cpu_s": server.started_cpu,
            "units": lines, "forked_units": forked_lines}


def main(argv: list[str]) -> None:
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the blocks' orphans are counted too
    pages = [Path(p).resolve() for p in argv] or docs_runner.pages()
    per_page = {p.name: measure(p) for p in pages if any(True for _ in units(p))}
    figures: dict[str, float] = {key: sum(page[key] for page in per_page.values())
                                 for key in ("fresh_cpu_s", "forked_cpu_s", "server_cpu_s", "units", "forked_units")}
    figures["pages"] = len(per_page)
    figures["saved_cpu_s"] = figures["fresh_cpu_s"] - figures["forked_cpu_s"] - figures["server_cpu_s"]
    figures["saved_share"] = figures["saved_cpu_s"] / figures["fresh_cpu_s"]
    for name, page in per_page.items():
        stem = Path(name).stem.lower().replace("-", "_")
        figures[f"{stem}_fresh_cpu_s"], figures[f"{stem}_forked_cpu_s"] = page["fresh_cpu_s"], page["forked_cpu_s"]
    print(json.dumps(figures, indent=1))
    if not argv:
        measured = [__file__, SERVER, ROOT / "tests" / "docs_runner.py"]  # a change to any asks for a new figure
        record("docs_forked", figures, measured, notes="CPU seconds; A: as tests/test_docs.py runs the pages; "
               "B: multigpu lines forked from tests/scripts/case_server.py --launches (one per page)")


if __name__ == "__main__":
    main(sys.argv[1:])
