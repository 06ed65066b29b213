"""Run the ```bash and ```python blocks of README.md and docs/*.md the way a newcomer would.

Why a runner of our own rather than Sybil or pytest-examples: those run a page's Python blocks inside
the pytest process (one namespace per page, or per block) and have no notion of shell blocks beyond
"call this evaluator". Ours must run every block as its own process - the blocks call ``mg.init()``,
start process groups and register exit handlers - in a sandbox folder holding the files the pages name
(``train.py``, ``hparams.yaml``, ``runs.yaml``: examples/quickstart/), and must list the blocks that
cannot run here with their reasons. What a library would still give us is the fence parser below.

A page's blocks run in order in one fresh temporary folder per page (a page may train in one block and
plot in the next, as a reader following it would), never in the repository. A block is skipped only
when the line before it is ``<!-- not run: REASON -->``; the reason is shown in the page source and
listed by ``python tests/docs_runner.py --table`` (docs/testing.md holds that table; a test compares).

    python tests/docs_runner.py --list            # every block: page:line, language, run or why not
    python tests/docs_runner.py README.md         # run one page's blocks here, with their output
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parents[1]
#: Languages that run. Output samples use a plain fence or ```text; files are shown as ```yaml.
RUN = ("bash", "python")
#: Every language a fence may name: anything else (```sh, ```console) is a mistake the test reports.
KNOWN = ("", "bash", "python", "text", "yaml")
SKIP = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
FENCE = re.compile(r"^(\s*)(```+)\s*([\w+-]*)\s*$")
#: Where the placeholder files come from: the README's own script and its settings.
QUICKSTART = REPO / "examples" / "quickstart"
BLOCK_TIMEOUT_S = 540  # a loaded 2-core machine runs the README block in ~4 minutes


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository, e.g. docs/queue.md
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    skip: Optional[str]  # the reason it does not run here, or None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a Markdown page, with the marker on the line before it (if any)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, ticks, lang = opening.groups()
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{ticks}\s*$", lines[end]):
            end += 1
        if end == len(lines):
            raise ValueError(f"{page.name}:{i + 1}: a fence that is never closed")
        body = "\n".join(
            line[len(indent) :] if line.startswith(indent) else line.lstrip()
            for line in lines[i + 1 : end]
        )
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP.search(before)
        found.append(
            Block(
                str(page.relative_to(REPO)),
                i + 1,
                lang,
                body + "\n",
                marker.group(1) if marker else None,
            )
        )
        i = end + 1
    return found


def runnable(block: Block) -> bool:
    return block.lang in RUN and block.skip is None


# ------------------------------------------------------------------------------------------ sandbox


def make_sandbox(root: Path) -> dict[str, str]:
    """A folder holding what the pages name, and the environment the blocks run with.

    ``train.py``, ``hparams.yaml``, ``runs.yaml``: the quickstart's files (the README's script), at the top,
    as in examples/quickstart/; ``examples/`` as in the repository, for pages that name its files.
    ``python``, ``multigpu`` and ``torchrun`` are this interpreter's (a shim folder first on PATH).
    """
    for item in QUICKSTART.iterdir():
        if item.is_file():
            shutil.copy(item, root / item.name)
    shutil.copytree(
        REPO / "examples",
        root / "examples",
        ignore=shutil.ignore_patterns("outputs", "__pycache__"),
    )
    shims = root / ".bin"
    shims.mkdir()
    # Scripts, not symbolic links: a link to a virtual environment's python outside its folder is not in
    # that environment (Python finds pyvenv.cfg next to the path it was started by).
    for name, args in (
        ("python", ""),
        ("python3", ""),
        ("multigpu", " -P -m multigpu"),
        ("torchrun", " -m torch.distributed.run"),
    ):
        shim = shims / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        shim.chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "PYTEST_"))
        and k
        not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")
    }
    env.update(
        PATH=f"{shims}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO / "src"),
        OMP_NUM_THREADS="1",
        MPLBACKEND="Agg",
        WANDB_MODE="offline",
        HOME=str(root / ".home"),
    )
    (root / ".home").mkdir()
    return env


def leftovers(folder: Path) -> list[int]:
    """Processes still running in ``folder`` (every process a block starts inherits it as its cwd)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if Path(os.readlink(entry / "cwd")).is_relative_to(folder):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def run_block(
    block: Block, root: Path, env: dict[str, str], timeout: float = BLOCK_TIMEOUT_S
) -> tuple[int, str, float]:
    """Run one block in ``root``: bash with ``set -euo pipefail`` (every line must succeed), Python as a
    file of its own in a fresh interpreter. Returns (status, output, seconds)."""
    if block.lang == "bash":
        command = ["bash", "-c", "set -euo pipefail\n" + block.source]
    else:
        script = root / f".block_{Path(block.page).stem}_{block.line}.py"
        script.write_text(block.source)
        command = [sys.executable, script.name]
    started = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return 124, f"{output}\n[timed out after {timeout:.0f} s]", time.monotonic() - started
    return proc.returncode, output, time.monotonic() - started


def run_page(page: Path, echo: bool = False) -> Iterator[tuple[Block, int, str, float]]:
    """Run a page's runnable blocks in order in one fresh sandbox; yield each result. Stops at the first
    failure (later blocks of a page usually build on earlier ones). Leaves no process behind."""
    todo = [b for b in blocks(page) if runnable(b)]
    if not todo:
        return
    with tempfile.TemporaryDirectory(prefix="multigpu-docs-") as tmp:
        root = Path(tmp).resolve()
        env = make_sandbox(root)
        try:
            for block in todo:
                status, output, seconds = run_block(block, root, env)
                if echo:
                    print(
                        f"--- {block.where} ({block.lang}): exit {status}, {seconds:.1f} s\n{output}",
                        flush=True,
                    )
                yield block, status, output, seconds
                if status != 0:
                    return
        finally:
            deadline = time.monotonic() + 15
            while leftovers(root) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = leftovers(root)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if left:
                raise AssertionError(f"{page.name}: processes left behind by its blocks: {left}")


# ------------------------------------------------------------------------------------------ listing


def table() -> str:
    """The Markdown table of docs/testing.md: per page, the blocks run and the blocks not run, with why."""
    rows = ["| page | blocks run | blocks not run here, and why |", "| --- | --- | --- |"]
    for page in pages():
        found = [b for b in blocks(page) if b.lang in RUN]
        skipped: dict[str, int] = {}
        for b in found:
            if b.skip:
                skipped[b.skip] = skipped.get(b.skip, 0) + 1
        why = " / ".join(f"{n} x {reason}" if n > 1 else reason for reason, n in skipped.items())
        name = str(page.relative_to(REPO))
        rows.append(
            f"| {name} | {sum(1 for b in found if not b.skip)} | {sum(skipped.values())}"
            f"{': ' + why if why else ''} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--table"]:
        print(table())
        return 0
    if argv[:1] == ["--list"]:
        for page in pages():
            for b in blocks(page):
                state = (
                    "run"
                    if runnable(b)
                    else (f"not run: {b.skip}" if b.skip else "not code (not run)")
                )
                print(f"{b.where:32} {b.lang or '(plain)':7} {state}")
        return 0
    worst = 0
    for name in argv or [str(p.relative_to(REPO)) for p in pages()]:
        for _block, status, _, _ in run_page(REPO / name, echo=True):
            worst = worst or status
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
