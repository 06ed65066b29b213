"""The doors of docs/security.md hold by construction: src/multigpu opens, writes, renames and deletes
files only through multigpu.fileio, and reads or writes the environment only where the architecture
says. A new line of code that opens its own file fails here, with the place named.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

SRC = REPO / "src" / "multigpu"

#: Calls that touch the file system by name (module function or method).
FORBIDDEN_FUNCTIONS = {
    "open",
    "os.open",
    "os.remove",
    "os.unlink",
    "os.rename",
    "os.replace",
    "os.renames",
    "os.mkdir",
    "os.makedirs",
    "os.rmdir",
    "os.removedirs",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.chmod",
    "os.mkfifo",
    "shutil.rmtree",
    "shutil.move",
    "shutil.copy",
    "shutil.copy2",
    "shutil.copyfile",
    "shutil.copytree",
    "torch.save",
    "torch.load",
    "io.open",
}
FORBIDDEN_METHODS = {
    "open",
    "read_text",
    "read_bytes",
    "write_text",
    "write_bytes",
    "unlink",
    "rename",
    "rmdir",
    "mkdir",
    "touch",
    "symlink_to",
    "hardlink_to",
    "savefig",
    "chmod",
}

#: (file, call) -> why it may stay. Each is a path code or the command line chose, a fixed system
#: file, or a third-party writer given a folder the door created and checked.
ALLOWED = {
    ("fileio.py", "*"): "the door itself",
    ("plots.py", ".savefig"): "matplotlib writes into a file object from Folder.open_new",
    (
        "checkpoint/files.py",
        "torch.save",
    ): "into the writer over a file Folder.open_new opened (the fallback "
    "when torch's private zip writer is not there)",
    (
        "checkpoint/dcp_safe.py",
        "torch.save",
    ): "into an in-memory BytesIO: plain data, re-serialized for DCP's reader",
}


def _handle(call: ast.Call, index: int) -> bool:
    args = call.args
    return len(args) > index and isinstance(args[index], ast.Name) and args[index].id == "handle"


def calls(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in FORBIDDEN_FUNCTIONS:
            yield node.lineno, func.id
        elif isinstance(func, ast.Attribute):
            base = func.value
            dotted = f"{base.id}.{func.attr}" if isinstance(base, ast.Name) else None
            if dotted in ("torch.save", "torch.load") and _handle(
                node, 1 if dotted == "torch.save" else 0
            ):
                # into or from a file object the door opened (named ``handle`` by convention)
                continue
            if dotted in FORBIDDEN_FUNCTIONS:
                yield node.lineno, dotted
            elif dotted is None or base.id not in ("os", "shutil", "torch", "io", "json", "self"):
                if func.attr in FORBIDDEN_METHODS:
                    yield node.lineno, f".{func.attr}"
                elif func.attr == "replace" and len(node.args) == 1 and not node.keywords:
                    yield node.lineno, ".replace"  # Path.replace(target); str.replace takes two


def test_every_file_operation_goes_through_the_door():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if (rel, "*") in ALLOWED:
            continue
        for line, call in calls(path):
            if (rel, call) not in ALLOWED:
                found.append(f"{rel}:{line} {call}")
    assert not found, "file operations outside multigpu.fileio:\n" + "\n".join(found)


#: Where the environment may be read or written, and why (docs/architecture.md: read in
#: distributed.world, written by the rooms that start processes).
ENVIRONMENT_ALLOWED = {
    "distributed/world.py": "reads where this process stands (the one reader)",
    "launch/local.py": "writes the workers' environment",
    "launch/worker.py": "the launched worker: reads what its launcher set for it",
    "launch/devices.py": "reads CUDA_VISIBLE_DEVICES to plan devices before any process starts",
    "queue/scheduler.py": "builds each run's environment through launch.environment.run_environment",
    "queue/slurm_jobs.py": "names the credentials a Slurm job must not inherit (launch.environment.run_environment)",
    "diagnostics/check.py": "starts the two runs it compares",
    "diagnostics/environment.py": "`multigpu env` shows the variables that steer distributed code",
    "diagnostics/doctor.py": "reports the host name Slurm gives a node",
    "launch/simulate.py": "marks the node launchers it starts as simulated (the job's simulated_node)",
    "launch/replicas.py": "starts each replica group's agent with its environment; quiets torchft's servers",
    "loggers.py": "the loggers' own settings (WANDB_PROJECT, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME)",
    "__init__.py": "MULTIGPU_TRACEBACK, the switch of the one-line error hook",
}


def test_the_environment_is_touched_only_where_the_architecture_says():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        tree = ast.parse(path.read_text(), str(path))
        uses = [
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and n.attr in ("environ", "getenv")
            and isinstance(n.value, ast.Name)
            and n.value.id == "os"
        ]
        if uses and rel not in ENVIRONMENT_ALLOWED:
            found += [f"{rel}:{line}" for line in uses]
    assert not found, "environment read or written outside its rooms:\n" + "\n".join(found)
