"""The layout is a promise: docs/architecture.md's "may import" table, checked against the code (ast).

A newcomer should be able to name the room of any line from the folder tree, and a dependency that
crosses the rooms' rules (the launcher importing a strategy, a checkpoint reader importing the
trainer) fails here instead of drifting unnoticed. Imports inside functions count too.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import PY, REPO, child_env

SRC = REPO / "src" / "multigpu"
TABLE = REPO / "docs" / "architecture.md"
#: At most this many modules directly in src/multigpu (the rest live in rooms).
MAX_FLAT = 12
#: No source file over this many lines (one job each, short enough to hold in your head), as `ruff format`
#: lays it out at 100 columns (`make lint` checks the layout: the cap cannot be met by widening lines).
MAX_LINES = 520


def module_name(path: Path) -> str:
    parts = [p for p in path.relative_to(SRC).with_suffix("").parts if p != "__init__"]
    return ".".join(parts) or "__init__"


def room_of(module: str) -> str:
    return module.split(".")[0] if module else "__init__"


def rules() -> dict[str, list[str]]:
    """room -> the entries of its "may import" cell."""
    table: dict[str, list[str]] = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"`[a-z_]+`", cells[0]):
            continue
        table[cells[0].strip("`")] = (
            re.findall(r"`([a-z_.]+)`", cells[2]) if cells[2] != "every room" else ["*"]
        )
    return table


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported multigpu module without the package prefix; "multigpu" for the package itself)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name[len("multigpu.") :])
                for a in node.names
                if a.name.startswith("multigpu.")
            ]
            found += [(node.lineno, "multigpu") for a in node.names if a.name == "multigpu"]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and (node.module == "multigpu" or node.module.startswith("multigpu."))
        ):
            base = node.module[len("multigpu.") :] if node.module != "multigpu" else ""
            for alias in node.names:
                if base:
                    found.append((node.lineno, base))
                elif (SRC / alias.name).is_dir() or (SRC / f"{alias.name}.py").exists():
                    found.append((node.lineno, alias.name))
                else:
                    found.append((node.lineno, "multigpu"))  # __version__ and the like
    return found


def allowed(entries: list[str], imported: str) -> bool:
    if "*" in entries:
        return True
    for entry in entries:
        if entry == "multigpu" and imported == "multigpu":
            return True
        if imported == entry or imported.startswith(entry + "."):
            return True
    return False


def test_the_table_names_every_room_in_the_tree():
    table = rules()
    rooms = {room_of(module_name(p)) for p in SRC.rglob("*.py")}
    assert rooms - set(table) == set(), (
        f"rooms missing from docs/architecture.md: {sorted(rooms - set(table))}"
    )
    assert set(table) - rooms == set(), f"table rows without a room: {sorted(set(table) - rooms)}"


def test_every_import_follows_the_table():
    table = rules()
    broken = []
    for path in sorted(SRC.rglob("*.py")):
        room = room_of(module_name(path))
        for line, imported in imports_of(path):
            if imported != "multigpu" and room_of(imported) == room:
                continue
            if not allowed(table[room], imported):
                broken.append(f"{path.relative_to(REPO)}:{line} ({room}) imports {imported}")
    assert not broken, "imports outside docs/architecture.md's table:\n" + "\n".join(broken)


def test_the_world_reads_without_torch():
    """`multigpu` answers without importing torch: the world reader uses the standard library only."""
    tree = ast.parse((SRC / "distributed" / "world.py").read_text())
    modules = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    modules |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert "torch" not in modules
    package = ast.parse((SRC / "distributed" / "__init__.py").read_text())
    assert not [n for n in ast.walk(package) if isinstance(n, (ast.Import, ast.ImportFrom))]


#: A bad flag of each command that starts work: refused before torch is imported.
BAD_FLAGS = [
    ["run", "--stop-timeout", "-5", "s.py"],
    ["doctor", "--sizes", "1,lots"],
    ["doctor", "--checkpoint-gb", "nan"],
    ["check", "--nproc", "2", "no-such.py"],
    ["queue", "no-such.yaml"],
    ["slurm", "--nodes", "2", "no-such.py"],
    ["plot"],
]
REFUSE = """
import contextlib, io, json, sys
from multigpu.cli import main
found = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    found.append([argv, code, (err.getvalue().strip().splitlines() or [""])[-1], "torch" in sys.modules])
print(json.dumps(found))
"""


def test_a_bad_flag_is_refused_before_torch_is_imported(tmp_path):
    """Every bad input is refused fast: its one line comes before torch's seconds of import (``doctor``'s
    front once imported torch for a string constant: a bad flag took 1 s of CPU instead of 0.06 s)."""
    done = subprocess.run(
        [PY, "-c", REFUSE, json.dumps(BAD_FLAGS)],
        cwd=tmp_path,
        env=child_env(),
        # one interpreter: a hang ends here
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for argv, code, line, torch in json.loads(done.stdout):
        assert code == 2 and line.startswith("multigpu: error:") and "HINT:" in line, (
            argv,
            code,
            line,
        )
        assert not torch, f"multigpu {' '.join(argv)} imported torch before refusing it"


def test_a_layout_a_newcomer_can_hold_in_their_head():
    flat = sorted(p.name for p in SRC.glob("*.py"))
    assert len(flat) <= MAX_FLAT, flat
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize(
    "entry",
    [
        "multigpu.Trainer",
        "multigpu.TrainerSettings",
        "multigpu.Loader",
        "multigpu.init",
        "multigpu.Run",
        "multigpu.Stages",
        "multigpu.World",
        "multigpu.run_on_main",
        "multigpu.MetricSums",
        "multigpu.config.load",
        "multigpu.checkpoint.latest",
        "multigpu.trainer.Trainer",
        "multigpu.trainer.move_to",
        "multigpu.write_file",
    ],
)
def test_public_names_and_documented_import_paths_still_work(entry):
    import importlib

    module, _, name = entry.rpartition(".")
    assert getattr(importlib.import_module(module), name) is not None
