"""Hostile and malformed input, table-driven, through the real command line (and plain ``python``).

Each case runs a real subprocess in a fresh folder and asserts what a user is promised:
- a non-zero exit, fast: under FAST_CPU_S of CPU, and ended before HANG_S (else it is a hang),
- exactly one ``multigpu: error: ... HINT: ...`` line naming the problem, and no traceback,
- nothing written outside the output folder, no file changed or removed,
- no process left behind,
- for planted pickles and shell injections: the planted command did not run.

The inputs cover every command and file format: CLI flags of run/slurm/queue/checkpoint, runs files,
hparams files and overrides, checkpoint manifests and shards, and the launchers' environment variables.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from conftest import PY, REPO, SCRIPTS, child_env, processes_with
from torch import nn

pytestmark = pytest.mark.timeout(120)
SLEEP = str(SCRIPTS / "sleep_run.py")
DIGITS = str(REPO / "examples" / "digits" / "train.py")
PWNED = "PWNED"  # the file every planted command tries to create (in the case's folder)


@dataclass
class Case:
    id: str
    argv: list[str]  # "multigpu" arguments; or, with python=True, the arguments of plain `python`
    expect: str  # a fragment of the error line
    setup: Optional[Callable[[Path], None]] = None  # writes input files into the case folder
    env: dict = field(default_factory=dict)
    python: bool = False
    # with python=True: a real interpreter of its own (else forked by the case server)
    fresh: bool = False


def write(name: str, text: str, binary: bool = False) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        (folder / name).write_bytes(text.encode("latin-1") if binary else text.encode())

    return setup


def runs(text: str) -> Callable[[Path], None]:
    return write("runs.yaml", text)


RUN_OK = f"  script: {SLEEP}\n  args: ['0']\n  out_dir_key: out_dir\n"
#: A module that, imported, creates PWNED in the current folder.
PLANT = f"import os\nos.system('touch {PWNED}')\n"


def planted_in_current_folder(folder: Path) -> None:
    """json.py, signal.py, multigpu.py and multigpu/ that would run if imported; the script in sub/ fails with
    one line of its own."""
    for name in ("json.py", "signal.py", "tempfile.py", "multigpu.py"):
        write(name, PLANT)(folder)
    (folder / "multigpu").mkdir()
    write("multigpu/__init__.py", PLANT)(folder)
    (folder / "sub").mkdir()
    write(
        "sub/s.py",
        "from multigpu.errors import ConfigError\n"
        'raise ConfigError("the script\'s own refusal.", "nothing to fix.")\n',
    )(folder)


BOMB = "".join(
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else ', '.join(['x'] * 9)}]\n"
    for i in range(8)
)


# ------------------------------------------------------------------------------- checkpoints


def _tiny() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def sharded_ckpt(folder: Path, name: str = "ckpt") -> Path:
    from multigpu.checkpoint import sharded

    model, opt = _tiny()
    return sharded.save(
        folder / name,
        3,
        model,
        opt,
        {"trainer": {"epoch": 1}},
        is_main=True,
        barrier=lambda: None,
        meta={"world_size": 1},
    )


def replicated_ckpt(folder: Path, name: str = "ckpt") -> Path:
    from multigpu.checkpoint import files

    model, opt = _tiny()
    return files.save_state(
        folder / name, 3, {"model": model.state_dict(), "optimizer": opt.state_dict()}
    )


def edit_manifest(step: Path, change: Callable[[dict], None]) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    change(manifest)
    (step / "manifest.json").write_text(json.dumps(manifest))


def refresh_entry(step: Path, name: str) -> None:
    from multigpu.checkpoint.files import file_digest

    size, crc = file_digest(step / name)
    edit_manifest(step, lambda m: m["files"].__setitem__(name, {"size": size, "crc32": crc}))


class Planted:
    """Unpickling this runs a shell command that creates PWNED in the current folder."""

    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


def digits_split(kind: str) -> Callable[[Path], None]:
    """The digits recipe's split file (outputs/digits-data/digits-0-0.2.pt), as something it must not read:
    a pipe (a read would block), a link (to /dev/zero: a read never ends), bytes that are no split, a torch
    file whose pickle runs a command."""

    def setup(folder: Path) -> None:
        data = folder / "outputs" / "digits-data"
        data.mkdir(parents=True)
        path = data / "digits-0-0.2.pt"
        if kind == "pipe":
            os.mkfifo(path)
        elif kind == "link":
            path.symlink_to("/dev/zero")
        elif kind == "garbage":
            path.write_bytes(b"\x80\x05not a split" * 100)
        else:
            torch.save({"train": Planted(), "valid": Planted()}, path)

    return setup


def planted_metadata(folder: Path) -> None:
    step = sharded_ckpt(folder)
    (step / ".metadata").write_bytes(pickle.dumps(Planted()))
    refresh_entry(step, ".metadata")  # the manifest verifies: only the unpickler stands in the way


def planted_byte_entry(folder: Path) -> None:
    """A DCP shard whose non-tensor entry (an optimizer hyperparameter) is a pickled command."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from multigpu.checkpoint import files

    model, opt = _tiny()
    model_state, optim_state = get_state_dict(model, [opt])
    for group in optim_state["param_groups"]:
        group["lr"] = Planted()
    tmp = folder / "ckpt" / ".tmp-step-00000003-x"
    tmp.mkdir(parents=True)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp), no_dist=True)
    torch.save({"trainer": {}}, tmp / "extra.pt")
    files.finalize_folder(tmp, 3, meta={"sharded": True})


def torn_shard(folder: Path) -> None:
    step = sharded_ckpt(folder)
    # one of the shards (our save writes two per rank on CPU)
    shard = sorted(step.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    refresh_entry(step, shard.name)


def build_attack(folder: Path) -> None:
    """BUILD on an admitted class (PosixPath) would set its attributes for the whole process."""
    step = sharded_ckpt(folder)
    body = (step / ".metadata").read_bytes()
    evil = (
        b"\x80\x02cpathlib\nPosixPath\nN}X\x06\x00\x00\x00parentcpathlib\nPosixPath\n"
        b"X\x0b\x00\x00\x00/tmp/victim\x85Rs\x86b0"
    )
    (step / ".metadata").write_bytes(evil + body[2:])
    refresh_entry(step, ".metadata")


def fifo_manifest(folder: Path) -> None:
    step = replicated_ckpt(folder)
    (step / "manifest.json").unlink()
    os.mkfifo(step / "manifest.json")


def linked_step(folder: Path) -> None:
    real = replicated_ckpt(folder, "elsewhere")
    (folder / "ckpt").mkdir()
    (folder / STEP).symlink_to(real)


def linked_consolidation_target(folder: Path) -> None:
    sharded_ckpt(folder)
    (folder / "ckpt" / "consolidated").symlink_to(folder.parent)


def bad_counters(folder: Path) -> None:
    from multigpu.checkpoint import files

    model = nn.Linear(2, 1)
    files.save_state(
        folder / "out" / "checkpoints",
        3,
        {
            "model": model.state_dict(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(),
            "trainer": {"epoch": -(10**12), "bogus": 1},
        },
    )


def linked_lock(folder: Path) -> None:
    runs(f"a:\n{RUN_OK}")(folder)
    (folder / "out" / ".locks").mkdir(parents=True)
    (folder / "out" / ".locks" / "a.lock").symlink_to(folder.parent / "precious.txt")


TRAIN_TINY = (
    "import torch, multigpu as mg; from torch import nn; from torch.utils.data import TensorDataset\n"
    "class T(mg.Trainer):\n    def compute_loss(self, b): return nn.functional.mse_loss(self.model(b[0]), b[1])\n"
    "run = mg.init(); T(run, nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1), out_dir='out', "
    "progress=False).fit(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)))"
)


def manifest_case(
    change: Callable[[dict], None], kind: str = "replicated"
) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        step = (replicated_ckpt if kind == "replicated" else sharded_ckpt)(folder)
        edit_manifest(step, change)

    return setup


def symlinked_state(folder: Path) -> None:
    step = replicated_ckpt(folder)
    (folder / "elsewhere.pt").write_bytes((step / "state.pt").read_bytes())
    (step / "state.pt").unlink()
    (step / "state.pt").symlink_to(folder / "elsewhere.pt")


def named_best(folder: Path) -> None:
    (folder / "best").mkdir()


STEP = "ckpt/step-00000003"

# ----------------------------------------------------------------------------------- the table

CASES = [
    # multigpu run: processes, devices, ports, timeouts, logs
    Case(
        "run-nproc-0",
        ["run", "--nproc", "0", "s.py"],
        "--nproc 0 must be at least 1",
        write("s.py", ""),
    ),
    Case(
        "run-nproc-negative",
        ["run", "--nproc", "-3", "s.py"],
        "--nproc -3 must be at least 1",
        write("s.py", ""),
    ),
    Case(
        "run-nproc-100000",
        ["run", "--nproc", "100000", "s.py"],
        "more than 4,096",
        write("s.py", ""),
    ),
    Case("run-nproc-text", ["run", "--nproc", "abc", "s.py"], "is not a number of processes"),
    Case("run-nproc-float", ["run", "--nproc", "1e23", "s.py"], "is not a number of processes"),
    Case(
        "run-gpus-per-proc-0",
        ["run", "--gpus-per-proc", "0", "s.py"],
        "--gpus-per-proc 0",
        write("s.py", ""),
    ),
    Case(
        "run-gpus-without-gpu",
        ["run", "--gpus", "0", "s.py"],
        "no GPU is visible",
        write("s.py", ""),
    ),
    Case(
        "run-procs-per-gpu-without-gpu",
        ["run", "--procs-per-gpu", "2", "s.py"],
        "needs a GPU but none is visible",
        write("s.py", ""),
    ),
    Case(
        "run-procs-per-gpu-huge",
        ["run", "--procs-per-gpu", "99999", "s.py"],
        "--procs-per-gpu 99999 is more than",
        write("s.py", ""),
    ),
    Case(
        "env-procs-per-device-zero",
        ["s.py"],
        "workers setting processes_per_device=0 is invalid",
        write("s.py", "import multigpu as mg\nmg.init()\n"),
        env={"MULTIGPU_JOB": '{"workers": {"processes_per_device": 0}}'},
        python=True,
    ),
    Case(
        "run-memory-share-garbage",
        ["run", "s.py"],
        "MULTIGPU_JOB setting memory_fraction=nan is invalid",
        write("s.py", "import multigpu as mg\nmg.init()\n"),
        env={"MULTIGPU_JOB": '{"memory_fraction": NaN}'},
    ),
    Case(
        "run-exit-timeout-zero",
        ["run", "--exit-timeout", "0", "s.py"],
        "--exit-timeout",
        write("s.py", ""),
    ),
    Case(
        "run-exit-timeout-garbage",
        ["run", "--exit-timeout", "1e9x", "s.py"],
        "--exit-timeout",
        write("s.py", ""),
    ),
    # code in the folder the command starts from is never imported (the launcher, the workers, the copier of
    # their stderr: python -P); the script's own error is the one line
    Case(
        "run-planted-modules-in-the-current-folder",
        ["run", "--nproc", "2", "sub/s.py"],
        "the script's own refusal",
        planted_in_current_folder,
    ),
    # a file beside the script that hides a module torch imports: one line naming it, and it never runs
    Case(
        "run-a-file-beside-the-script-hides-a-module",
        ["run", "s.py"],
        "random.py beside s.py hides the module",
        lambda folder: (write("s.py", "import torch\n")(folder), write("random.py", PLANT)(folder)),
    ),
    Case(
        "run-gpus-garbage",
        ["run", "--gpus", "0,x", "s.py"],
        "is not a GPU index",
        write("s.py", ""),
    ),
    Case(
        "run-gpus-huge",
        ["run", "--gpus", "0-99999999999", "s.py"],
        "is not a GPU index",
        write("s.py", ""),
    ),
    Case(
        "run-port-too-high",
        ["run", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "70000", "s.py"],
        "--master-port 70000",
        write("s.py", ""),
    ),
    Case(
        "run-port-zero", ["run", "--master-port", "0", "s.py"], "--master-port 0", write("s.py", "")
    ),
    Case(
        "run-log-dir-is-file", ["run", "--log-dir", "s.py", "s.py"], "is a file", write("s.py", "")
    ),
    Case(
        "run-log-dir-under-file",
        ["run", "--log-dir", "s.py/logs", "s.py"],
        "cannot create --log-dir",
        write("s.py", ""),
    ),
    Case(
        "run-stop-timeout-negative",
        ["run", "--stop-timeout", "-5", "s.py"],
        "--stop-timeout -5",
        write("s.py", ""),
    ),
    Case(
        "run-rdzv-timeout-negative",
        ["run", "--rdzv-timeout", "-5", "s.py"],
        "--rdzv-timeout -5",
        write("s.py", ""),
    ),
    Case(
        "run-rdzv-endpoint-no-port",
        ["run", "--rdzv-endpoint", "nohost", "s.py"],
        "is not HOST:PORT",
        write("s.py", ""),
    ),
    Case(
        "run-rdzv-endpoint-port-range",
        ["run", "--rdzv-endpoint", "h:99999", "s.py"],
        "is not HOST:PORT",
        write("s.py", ""),
    ),
    Case(
        "run-nnodes-zero",
        ["run", "--nnodes", "0", "s.py"],
        "need 0 < MIN <= MAX",
        write("s.py", ""),
    ),
    Case(
        "run-nnodes-inverted",
        ["run", "--nnodes", "2:1", "s.py"],
        "need 0 < MIN <= MAX",
        write("s.py", ""),
    ),
    Case(
        "run-nnodes-huge",
        ["run", "--nnodes", "100000000000000000000000", "s.py"],
        "--nnodes",
        write("s.py", ""),
    ),
    Case(
        "run-nnodes-without-master",
        ["run", "--nnodes", "2", "s.py"],
        "needs --master-addr",
        write("s.py", ""),
    ),
    Case(
        "run-node-rank-outside",
        [
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "5",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "29999",
            "s.py",
        ],
        "--node-rank 5 is outside",
        write("s.py", ""),
    ),
    Case(
        "run-master-addr-newline",
        ["run", "--nnodes", "2", "--master-addr", "h\nx", "--master-port", "29999", "s.py"],
        "--master-addr",
        write("s.py", ""),
    ),
    Case(
        "run-max-restarts-negative",
        ["run", "--max-restarts", "-1", "s.py"],
        "--max-restarts -1",
        write("s.py", ""),
    ),
    Case(
        "run-simulate-one-node",
        ["run", "--simulate-nodes", "1", "s.py"],
        "--simulate-nodes 1",
        write("s.py", ""),
    ),
    Case(
        "run-simulate-huge",
        ["run", "--simulate-nodes", "100000", "s.py"],
        "--simulate-nodes 100000",
        write("s.py", ""),
    ),
    Case(
        "run-simulate-with-port",
        ["run", "--simulate-nodes", "2", "--master-port", "29500", "s.py"],
        "drop --master-port",
        write("s.py", ""),
    ),
    Case("run-missing-script", ["run", "nope.py"], "does not exist"),
    Case("run-script-is-folder", ["run", "."], "is a folder"),
    # multigpu slurm: every value that reaches the sbatch script
    Case(
        "slurm-nodes-zero",
        ["slurm", "--dry-run", "--nodes", "0", "s.py"],
        "--nodes 0",
        write("s.py", ""),
    ),
    Case(
        "slurm-partition-newline",
        ["slurm", "--dry-run", "--partition", f"gpu\ntouch {PWNED}", "s.py"],
        "--partition",
        write("s.py", ""),
    ),
    Case(
        "slurm-account-semicolon",
        ["slurm", "--dry-run", "--account", f"a;touch {PWNED}", "s.py"],
        "--account",
        write("s.py", ""),
    ),
    Case(
        "slurm-mem-newline",
        ["slurm", "--dry-run", "--mem", f"64G\ntouch {PWNED}", "s.py"],
        "--mem",
        write("s.py", ""),
    ),
    Case(
        "slurm-sbatch-arg-newline",
        ["slurm", "--dry-run", f"--sbatch-arg=--qos=high\ntouch {PWNED}", "s.py"],
        "--sbatch-arg",
        write("s.py", ""),
    ),
    Case(
        "slurm-sbatch-arg-not-a-flag",
        ["slurm", "--dry-run", "--sbatch-arg=qos", "s.py"],
        "--sbatch-arg",
        write("s.py", ""),
    ),
    Case(
        "slurm-time-injection",
        ["slurm", "--dry-run", "--time", f"1:00; touch {PWNED}", "s.py"],
        "--time",
        write("s.py", ""),
    ),
    Case(
        "slurm-job-name-space",
        ["slurm", "--dry-run", "--job-name", "a b", "s.py"],
        "--job-name",
        write("s.py", ""),
    ),
    Case(
        "slurm-run-dir-is-file",
        ["slurm", "--dry-run", "--run-dir", "s.py", "s.py"],
        "HINT",
        write("s.py", ""),
    ),
    Case(
        "slurm-run-dir-space",
        ["slurm", "--dry-run", "--run-dir", "out/a b", "s.py"],
        "holds ' ', which an #SBATCH",
        write("s.py", ""),
    ),
    Case(
        "slurm-run-dir-percent",
        ["slurm", "--dry-run", "--run-dir", "out/a%j", "s.py"],
        "contains %, which #SBATCH",
        write("s.py", ""),
    ),
    Case(
        "slurm-argument-newline",
        ["slurm", "--dry-run", "s.py", f"x\ntouch {PWNED}"],
        "control characters",
        write("s.py", ""),
    ),
    Case(
        "slurm-cpus-zero",
        ["slurm", "--dry-run", "--cpus-per-task", "0", "s.py"],
        "--cpus-per-task 0",
        write("s.py", ""),
    ),
    Case(
        "slurm-nproc-huge",
        ["slurm", "--dry-run", "--nproc-per-node", "100000", "s.py"],
        "more than 4,096",
        write("s.py", ""),
    ),
    Case(
        "slurm-gpus-negative",
        ["slurm", "--dry-run", "--gpus-per-node", "-1", "s.py"],
        "--gpus-per-node -1",
        write("s.py", ""),
    ),
    Case("slurm-status-not-an-id", ["slurm", "status", "abc"], "is not a Slurm job id"),
    Case("slurm-logs-injection", ["slurm", "logs", f"1;touch {PWNED}"], "is not a Slurm job id"),
    Case("slurm-status-two-ids", ["slurm", "status", "1", "2"], "unrecognized arguments"),
    # multigpu slurm: GPUs asked for in every way Slurm takes them, the new job flags, job ids and history
    Case(
        "slurm-gpus-per-node-newline",
        ["slurm", "--dry-run", "--gpus-per-node", f"a100:4\ntouch {PWNED}", "s.py"],
        "is not a GPU count",
        write("s.py", ""),
    ),
    Case(
        "slurm-gpus-per-node-unicode-digit",
        ["slurm", "--dry-run", "--gpus-per-node", "\u0664", "s.py"],
        "is not a GPU count",
        write("s.py", ""),
    ),
    Case(
        "slurm-gres-newline",
        ["slurm", "--dry-run", "--gres", f"gpu:4\ntouch {PWNED}", "s.py"],
        "--gres",
        write("s.py", ""),
    ),
    Case(
        "slurm-gres-not-a-gpu",
        ["slurm", "--dry-run", "--gres", "nic:1", "s.py"],
        "--gres",
        write("s.py", ""),
    ),
    Case(
        "slurm-gpus-asked-twice",
        ["slurm", "--dry-run", "--gpus-per-node", "4", "--sbatch-arg=--gres=gpu:2", "s.py"],
        "GPUs are asked for twice",
        write("s.py", ""),
    ),
    Case(
        "slurm-gpus-uneven-over-nodes",
        ["slurm", "--dry-run", "--nodes", "2", "--sbatch-arg=--gpus=3", "s.py"],
        "cannot share evenly",
        write("s.py", ""),
    ),
    Case(
        "slurm-sbatch-gres-unreadable",
        ["slurm", "--dry-run", "--sbatch-arg=--gres=gpu:a:b:2", "s.py"],
        "cannot read",
        write("s.py", ""),
    ),
    Case(
        "slurm-sbatch-gpus-per-task-word",
        ["slurm", "--dry-run", "--sbatch-arg=--gpus-per-task=many", "s.py"],
        "cannot read a GPU count",
        write("s.py", ""),
    ),
    Case(
        "slurm-sbatch-arg-structural",
        ["slurm", "--dry-run", "--sbatch-arg=--ntasks-per-node=4", "s.py"],
        "sets --ntasks-per-node",
        write("s.py", ""),
    ),
    Case(
        "slurm-sbatch-arg-abbreviated",
        ["slurm", "--dry-run", "--sbatch-arg=--job=x", "s.py"],
        "sets --job-name",
        write("s.py", ""),
    ),
    Case(
        "slurm-sbatch-arg-short-form",
        ["slurm", "--dry-run", "--sbatch-arg=-N2", "s.py"],
        "--sbatch-arg",
        write("s.py", ""),
    ),
    Case(
        "slurm-qos-twice",
        ["slurm", "--dry-run", "--qos", "a", "--sbatch-arg=--qos=b", "s.py"],
        "both as a flag",
        write("s.py", ""),
    ),
    Case(
        "slurm-qos-newline",
        ["slurm", "--dry-run", "--qos", f"high\ntouch {PWNED}", "s.py"],
        "--qos",
        write("s.py", ""),
    ),
    Case(
        "slurm-constraint-injection",
        ["slurm", "--dry-run", "--constraint", f"a100;touch {PWNED}", "s.py"],
        "--constraint",
        write("s.py", ""),
    ),
    Case(
        "slurm-constraint-newline",
        ["slurm", "--dry-run", "--constraint", f"a100\ntouch {PWNED}", "s.py"],
        "--constraint",
        write("s.py", ""),
    ),
    Case(
        "slurm-job-name-unicode",
        ["slurm", "--dry-run", "--job-name", "tr\u00e4in", "s.py"],
        "--job-name",
        write("s.py", ""),
    ),
    Case(
        "slurm-status-unicode-digits",
        ["slurm", "status", "\u0661\u0662\u0663"],
        "is not a Slurm job id",
    ),
    Case("slurm-logs-unicode-task", ["slurm", "logs", "12_\u0662"], "is not a Slurm job id"),
    Case("slurm-status-days-zero", ["slurm", "status", "--days", "0"], "--days 0"),
    # runs files
    Case("runs-missing", ["queue", "nope.yaml"], "cannot read nope.yaml"),
    Case("runs-is-folder", ["queue", "."], "is a folder"),
    Case(
        "runs-invalid-yaml",
        ["queue", "runs.yaml"],
        "runs.yaml:2: invalid YAML",
        runs("a:\n  b: [1, 2\n"),
    ),
    Case(
        "runs-invalid-utf8",
        ["queue", "runs.yaml"],
        "not valid UTF-8",
        write("runs.yaml", "a:\n  s: \xff\xfe\n", True),
    ),
    Case("runs-alias-bomb", ["queue", "runs.yaml"], "expands to more than", runs(BOMB)),
    Case(
        "runs-recursive-alias", ["queue", "runs.yaml"], "refers to itself", runs("a: &x\n  b: *x\n")
    ),
    Case(
        "runs-duplicate-run",
        ["queue", "runs.yaml"],
        "runs.yaml:7: key 'a' is given twice (also at line 1)",
        runs(f"a:\n{RUN_OK}b:\n  script: x\na:\n  script: y\n"),
    ),
    Case(
        "runs-duplicate-setting",
        ["queue", "runs.yaml"],
        "key 'gpus' is given twice",
        runs(f"a:\n{RUN_OK}  gpus: 1\n  gpus: 2\n"),
    ),
    Case(
        "runs-name-dotdot",
        ["queue", "runs.yaml"],
        "run name '../escape' is not allowed",
        runs(f"../escape:\n{RUN_OK}"),
    ),
    Case(
        "runs-name-absolute", ["queue", "runs.yaml"], "is not allowed", runs(f"/tmp/abs:\n{RUN_OK}")
    ),
    Case(
        "runs-name-dot-slash",
        ["queue", "runs.yaml"],
        "run name './net' is not allowed",
        runs(f"./net:\n{RUN_OK}"),
    ),
    Case("runs-name-nul", ["queue", "runs.yaml"], "is not allowed", runs(f'"a\\0b":\n{RUN_OK}')),
    Case(
        "runs-name-too-long",
        ["queue", "runs.yaml"],
        "is not allowed",
        runs(f"{'n' * 300}:\n{RUN_OK}"),
    ),
    Case(
        "runs-name-hidden",
        ["queue", "runs.yaml"],
        "run name '.hidden' is not allowed",
        runs(f".hidden:\n{RUN_OK}"),
    ),
    Case("runs-name-markup", ["queue", "runs.yaml"], "is not allowed", runs(f"'a[/]':\n{RUN_OK}")),
    Case(
        "runs-names-case",
        ["queue", "runs.yaml"],
        "differ only in case",
        runs(f"Net:\n{RUN_OK}net:\n{RUN_OK}"),
    ),
    Case(
        "runs-name-setting",
        ["queue", "runs.yaml"],
        "sets name:",
        runs(f"a:\n{RUN_OK}  name: ../x\n"),
    ),
    Case(
        "runs-env-injection",
        ["queue", "runs.yaml", "--slurm", "--dry-run"],
        "is not an identifier",
        runs(f"a:\n{RUN_OK}  env: {{'X=1; touch {PWNED}; Y': v}}\n"),
    ),
    Case(
        "runs-env-equals",
        ["queue", "runs.yaml", "--slots", "1"],
        "is not an identifier",
        runs(f"a:\n{RUN_OK}  env: {{'A=B': v}}\n"),
    ),
    Case(
        "runs-env-preload",
        ["queue", "runs.yaml", "--slots", "1"],
        "LD_PRELOAD names a preload",
        runs(f"a:\n{RUN_OK}  env: {{LD_PRELOAD: /tmp/x.so}}\n"),
    ),
    Case(
        "runs-env-value-newline",
        ["queue", "runs.yaml", "--slots", "1"],
        "control characters",
        runs(f'a:\n{RUN_OK}  env: {{A: "x\\ny"}}\n'),
    ),
    Case(
        "runs-module-injection",
        ["queue", "runs.yaml"],
        "is not a module name",
        runs("a:\n  module: 'os; touch x'\n"),
    ),
    Case(
        "runs-mode-unknown",
        ["queue", "runs.yaml"],
        "mode 'best' is neither min nor max",
        runs(f"a:\n{RUN_OK}  metric: valid_loss\n  mode: best\n"),
    ),
    Case(
        "runs-only-empty",
        ["queue", "runs.yaml", "--only", ""],
        "--only names no run",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "runs-only-unknown",
        ["queue", "runs.yaml", "--only", "zz"],
        "--only names 'zz'",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-slots-zero",
        ["queue", "runs.yaml", "--slots", "0"],
        "--slots 0",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-slots-huge",
        ["queue", "runs.yaml", "--slots", "100000"],
        "more than 4,096",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-max-parallel-zero",
        ["queue", "runs.yaml", "--max-parallel", "0"],
        "--max-parallel 0",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-gpus-per-run-zero",
        ["queue", "runs.yaml", "--gpus-per-run", "0"],
        "--gpus-per-run 0",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-out-is-file",
        ["queue", "runs.yaml", "--out", "runs.yaml"],
        "is a file",
        runs(f"a:\n{RUN_OK}"),
    ),
    # the diagnostics commands: check, doctor, plot, env
    Case("check-nproc-one", ["check", "--nproc", "1", "s.py"], "--nproc 1", write("s.py", "")),
    Case("check-steps-zero", ["check", "--steps", "0", "s.py"], "--steps 0", write("s.py", "")),
    Case(
        "check-tolerance-nan",
        ["check", "--tolerance", "nan", "s.py"],
        "--tolerance nan",
        write("s.py", ""),
    ),
    Case("check-missing-script", ["check", "nothere.py"], "does not exist"),
    Case(
        "check-show-output-value",
        ["check", "--show-output=yes", "s.py"],
        "--show-output: ignored explicit argument",
        write("s.py", ""),
    ),
    Case("doctor-sizes-text", ["doctor", "--sizes", "1,lots"], "--sizes"),
    Case("doctor-disk-nan", ["doctor", "--checkpoint-gb", "nan"], "--checkpoint-gb nan"),
    Case("doctor-skew-negative", ["doctor", "--max-clock-skew", "-1"], "--max-clock-skew -1"),
    Case("plot-empty-folder", ["plot", "."], "holds no metrics.csv"),
    Case(
        "plot-out-not-png",
        ["plot", "run", "--out", "x.txt"],
        "does not end in .png",
        lambda f: (
            (f / "run").mkdir(),
            (f / "run" / "metrics.csv").write_text("step,epoch,valid_loss\n1,1,0.5\n"),
        ),
    ),
    Case(
        "plot-unknown-metric",
        ["plot", "run", "--metric", "valid_nope", "--out", "x.png"],
        "not a column",
        lambda f: (
            (f / "run").mkdir(),
            (f / "run" / "metrics.csv").write_text("step,epoch,valid_loss\n1,1,0.5\n"),
        ),
    ),
    Case("env-nproc-zero", ["env", "--check", "--nproc", "0"], "--nproc 0"),
    Case(
        "runs-gpus-zero",
        ["queue", "runs.yaml"],
        "gpus 0 must be at least 1",
        runs(f"a:\n{RUN_OK}  gpus: 0\n"),
    ),
    Case(
        "runs-nproc-huge",
        ["queue", "runs.yaml"],
        "more than 4,096",
        runs(f"a:\n{RUN_OK}  nproc: 100000\n"),
    ),
    Case(
        "runs-nproc-text",
        ["queue", "runs.yaml"],
        "nproc must be",
        runs(f"a:\n{RUN_OK}  nproc: 1e23\n"),
    ),
    Case(
        "runs-cycle",
        ["queue", "runs.yaml"],
        "inheritance cycle",
        runs(f"a < b:\n{RUN_OK}b < a:\n{RUN_OK}"),
    ),
    Case(
        "runs-unknown-parent",
        ["queue", "runs.yaml"],
        "which is not defined",
        runs(f"a < zz:\n{RUN_OK}"),
    ),
    Case(
        "runs-unknown-key",
        ["queue", "runs.yaml"],
        "unknown key 'gpu'",
        runs(f"a:\n{RUN_OK}  gpu: 1\n"),
    ),
    Case(
        "runs-script-and-module",
        ["queue", "runs.yaml"],
        "exactly one of script",
        runs(f"a:\n{RUN_OK}  module: m\n"),
    ),
    Case(
        "runs-top-level-list",
        ["queue", "runs.yaml"],
        "top level must be a mapping",
        runs("- a\n- b\n"),
    ),
    Case(
        "runs-python-tag",
        ["queue", "runs.yaml"],
        "invalid YAML",
        runs(f"a: !!python/object/apply:os.system ['touch {PWNED}']\n"),
    ),
    Case(
        "queue-slurm-partition-newline",
        ["queue", "runs.yaml", "--slurm", "--dry-run", "--partition", "a\nb"],
        "--partition",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-array-without-slurm",
        ["queue", "runs.yaml", "--array"],
        "is for Slurm jobs",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-status-without-slurm",
        ["queue", "runs.yaml", "--status"],
        "is for Slurm jobs",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-slurm-local-gpus",
        ["queue", "runs.yaml", "--slurm", "--dry-run", "--gpus", "0,1"],
        "chooses this machine's GPUs",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-array-max-parallel-zero",
        ["queue", "runs.yaml", "--slurm", "--array", "--dry-run", "--max-parallel", "0"],
        "--max-parallel 0",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-slurm-gres-newline",
        ["queue", "runs.yaml", "--slurm", "--array", "--dry-run", "--gres", "gpu:1\nx"],
        "--gres",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "runs-slurm-array-not-a-bool",
        ["queue", "runs.yaml", "--slurm", "--dry-run"],
        "must be true or false",
        runs(f"a:\n{RUN_OK}  slurm_array: 'yes'\n"),
    ),
    # checkpoints: manifests, shards, planted pickles, outputs that would overwrite
    Case("ckpt-list-missing", ["checkpoint", "list", "nowhere"], "is not a folder"),
    Case("ckpt-verify-missing", ["checkpoint", "verify", "nowhere"], "no checkpoint folder"),
    Case(
        "ckpt-manifest-dotdot",
        ["checkpoint", "verify", STEP],
        "not inside the checkpoint folder",
        manifest_case(
            lambda m: m["files"].__setitem__(
                "../../../etc/passwd", {"size": 1, "crc32": "00000000"}
            )
        ),
    ),
    Case(
        "ckpt-manifest-absolute",
        ["checkpoint", "verify", STEP],
        "not inside the checkpoint folder",
        manifest_case(
            lambda m: m["files"].__setitem__("/etc/passwd", {"size": 1, "crc32": "00000000"})
        ),
    ),
    Case(
        "ckpt-manifest-files-list",
        ["checkpoint", "verify", STEP],
        "no 'files' mapping",
        manifest_case(lambda m: m.__setitem__("files", ["state.pt"])),
    ),
    Case(
        "ckpt-manifest-no-crc",
        ["checkpoint", "verify", STEP],
        "8-digit hex 'crc32'",
        manifest_case(lambda m: m["files"]["state.pt"].pop("xxh3")),
    ),
    Case(
        "ckpt-manifest-empty-files",
        ["checkpoint", "verify", STEP],
        "does not list state.pt",
        manifest_case(lambda m: m.__setitem__("files", {})),
    ),
    Case(
        "ckpt-manifest-not-json",
        ["checkpoint", "verify", STEP],
        "is not valid JSON",
        lambda f: (replicated_ckpt(f) / "manifest.json").write_text("{nope"),
    ),
    Case(
        "ckpt-manifest-step-text",
        ["checkpoint", "verify", STEP],
        "'step' is not an integer",
        manifest_case(lambda m: m.__setitem__("step", "3; rm")),
    ),
    Case(
        "ckpt-state-symlink", ["checkpoint", "verify", STEP], "is a symbolic link", symlinked_state
    ),
    Case(
        "ckpt-truncated",
        ["checkpoint", "verify", STEP],
        "(truncated?)",
        lambda f: (replicated_ckpt(f) / "state.pt").write_bytes(b"x"),
    ),
    Case(
        "ckpt-sharded-without-shards",
        ["checkpoint", "verify", STEP],
        "lists no .distcp shard",
        manifest_case(
            lambda m: [m["files"].pop(k) for k in list(m["files"]) if k.endswith(".distcp")],
            "sharded",
        ),
    ),
    Case(
        "ckpt-consolidate-planted-metadata",
        ["checkpoint", "consolidate", STEP, "--out", "out"],
        "posix.system, which is not checkpoint metadata",
        planted_metadata,
    ),
    Case(
        "ckpt-resume-planted-entry",
        [
            "-c",
            "import multigpu as mg, torch; from torch import nn; "
            "run = mg.init(strategy='fsdp'); m, o = run.setup(nn.Sequential(nn.Linear(3, 4), "
            "nn.Linear(4, 2)), lambda p: torch.optim.AdamW(p)); "
            "run.load_checkpoint('ckpt', m, o)",
        ],
        "non-tensor checkpoint entry was refused",
        planted_byte_entry,
        python=True,
    ),
    Case(
        "ckpt-resume-planted-metadata",
        [
            "-c",
            "import multigpu as mg, torch; from torch import nn; "
            "run = mg.init(strategy='fsdp'); m, o = run.setup(nn.Sequential("
            "nn.Linear(3, 4), nn.Linear(4, 2)), lambda p: torch.optim.AdamW(p)); "
            "run.load_checkpoint('ckpt/step-00000003', m, o)",
        ],
        "posix.system, which is not checkpoint metadata",
        planted_metadata,
        python=True,
    ),
    Case(
        "ckpt-replicated-resume-ignores-metadata",
        [
            "-c",
            "import multigpu as mg, torch; from torch import nn; "
            "run = mg.init(); m, o = run.setup(nn.Linear(3, 4), "
            "lambda p: torch.optim.AdamW(p)); "
            "run.load_checkpoint('ckpt/step-00000003', m, o)",
        ],
        "is a sharded (DCP) checkpoint",
        planted_metadata,
        python=True,
    ),
    Case(
        "ckpt-consolidate-into-its-parent",
        ["checkpoint", "consolidate", STEP, "--out", "ckpt"],
        "already exists",
        lambda f: sharded_ckpt(f) and None,
    ),
    Case(
        "ckpt-consolidate-into-itself",
        ["checkpoint", "consolidate", STEP, "--out", f"{STEP}/x"],
        "is inside the checkpoint",
        lambda f: sharded_ckpt(f) and None,
    ),
    Case(
        "ckpt-consolidate-best",
        ["checkpoint", "consolidate", "best"],
        "no checkpoint at best",
        named_best,
    ),
    Case(
        "ckpt-consolidate-torn-shard",
        ["checkpoint", "consolidate", STEP, "--out", "out"],
        "HINT",
        torn_shard,
    ),
    Case(
        "ckpt-consolidate-replicated",
        ["checkpoint", "consolidate", STEP, "--out", "out"],
        "is not a sharded",
        lambda f: replicated_ckpt(f) and None,
    ),
    Case(
        "ckpt-metadata-build-attack",
        ["checkpoint", "consolidate", STEP, "--out", "out"],
        "sets attributes of PosixPath",
        build_attack,
    ),
    Case("ckpt-fifo-manifest", ["checkpoint", "verify", STEP], "not a regular file", fifo_manifest),
    Case("ckpt-linked-step", ["checkpoint", "verify", STEP], "is a symbolic link", linked_step),
    Case(
        "ckpt-linked-consolidation-target",
        ["checkpoint", "consolidate", STEP],
        "is a symbolic link",
        linked_consolidation_target,
    ),
    Case(
        "ckpt-resume-bad-counters",
        ["-c", TRAIN_TINY],
        "trainer counters are malformed",
        bad_counters,
        python=True,
        fresh=True,
    ),
    Case(
        "runs-env-pythonwarnings",
        ["queue", "runs.yaml", "--slots", "1"],
        "a runs file may not set it",
        runs(
            f"a:\n{RUN_OK}  env: {{PYTHONWARNINGS: 'ignore::antigravity.X', BROWSER: 'touch {PWNED}'}}\n"
        ),
    ),
    Case(
        "runs-env-slurm-arithmetic",
        ["queue", "runs.yaml", "--slurm", "--dry-run"],
        "a runs file may not set it",
        runs(f"a:\n{RUN_OK}  env: {{SLURM_JOB_ID: 'x[$(touch {PWNED})]'}}\n"),
    ),
    Case(
        "runs-env-visible-devices",
        ["queue", "runs.yaml", "--slots", "1"],
        "is set by the queue",
        runs(f"a:\n{RUN_OK}  env: {{CUDA_VISIBLE_DEVICES: '0'}}\n"),
    ),
    Case(
        "check-procs-per-gpu-without-gpu",
        ["check", "--procs-per-gpu", "2", "s.py"],
        "needs a GPU but none is visible",
        write("s.py", ""),
    ),
    Case(
        "runs-share-too-fine",
        ["queue", "runs.yaml", "--slots", "1"],
        "neither a whole number nor a share",
        runs(f"a:\n{RUN_OK}  gpus: 1.0e-300\n"),
    ),
    Case(
        "runs-share-with-processes",
        ["queue", "runs.yaml", "--slots", "1"],
        "runs one process",
        runs(f"a:\n{RUN_OK}  gpus: 0.5\n  nproc: 64\n"),
    ),
    Case(
        "queue-runs-per-gpu-0",
        ["queue", "runs.yaml", "--slots", "1", "--runs-per-gpu", "0"],
        "--runs-per-gpu 0 must be at least 1",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "queue-packed-on-slurm",
        ["queue", "runs.yaml", "--slurm", "--dry-run", "--runs-per-gpu", "4"],
        "Slurm jobs do not do",
        runs(f"a:\n{RUN_OK}"),
    ),
    Case(
        "runs-script-flag",
        ["queue", "runs.yaml", "--slots", "1"],
        "starts with '-'",
        runs("a:\n  script: --log-dir=/tmp/outside\n  args: [x.py]\n"),
    ),
    Case(
        "runs-surrogate",
        ["queue", "runs.yaml", "--slots", "1"],
        "not valid Unicode",
        runs(f'a:\n{RUN_OK}  env: {{NCCL_DEBUG: "\\ud800"}}\n'),
    ),
    Case(
        "runs-long-chain",
        ["queue", "runs.yaml"],
        "inheritance chain longer than",
        runs(
            "".join(f"r{i} < r{i - 1}: {{}}\n" for i in range(299, 0, -1)) + "r0:\n  script: x.py\n"
        ),
    ),
    Case(
        "queue-linked-lock",
        ["queue", "runs.yaml", "--slots", "1", "--out", "out"],
        "symbolic link",
        linked_lock,
    ),
    # hparams files and overrides, under plain python (the one-line hook) and under multigpu run
    Case(
        "hparams-duplicate-key",
        [DIGITS, "h.yaml"],
        "h.yaml:3: key 'trainer' is given twice",
        write("h.yaml", "trainer:\n  epochs: 1\ntrainer:\n  epochs: 2\n"),
        python=True,
        fresh=True,
    ),
    Case(
        "hparams-alias-bomb",
        [DIGITS, "h.yaml"],
        "expands to more than",
        write("h.yaml", BOMB),
        python=True,
    ),
    Case(
        "hparams-python-tag",
        [DIGITS, "h.yaml"],
        "invalid YAML",
        write("h.yaml", f"model: !!python/object/apply:os.system ['touch {PWNED}']\n"),
        python=True,
    ),
    Case(
        "hparams-unknown-override",
        [DIGITS, "trainer.epoch=3"],
        "did you mean 'trainer.epochs'",
        python=True,
    ),
    Case("hparams-empty-override", [DIGITS, "=3"], "is not KEY=VALUE", python=True),
    Case(
        "hparams-override-bomb",
        [DIGITS, "model.hidden=" + BOMB.replace("\n", ", ").join("{}")],
        "expands to more than",
        python=True,
    ),
    Case(
        "hparams-under-run",
        ["run", DIGITS, "h.yaml"],
        "key 'trainer' is given twice",
        write("h.yaml", "trainer: {}\ntrainer: {}\n"),
    ),
    # the digits recipe's split file, in the data folder a queue's runs share (evaluate: no prepare stage)
    Case(
        "digits-split-pipe",
        [DIGITS, "start_stage=train"],
        "is not a plain file",
        digits_split("pipe"),
        python=True,
    ),
    Case(
        "digits-split-link",
        [DIGITS, "start_stage=evaluate"],
        "is not a plain file",
        digits_split("link"),
        python=True,
    ),
    Case(
        "digits-split-garbage",
        [DIGITS, "start_stage=train"],
        "is not a split of the digits",
        digits_split("garbage"),
        python=True,
    ),
    Case(
        "digits-split-planted-pickle",
        [DIGITS, "start_stage=train"],
        "is not a split of the digits",
        digits_split("pickle"),
        python=True,
    ),
    # launchers' environment variables
    Case(
        "env-rank-without-world-size",
        ["-c", "import multigpu as mg; mg.init()"],
        "RANK is set but WORLD_SIZE is not",
        env={"RANK": "0"},
        python=True,
        fresh=True,
    ),
    Case(
        "env-world-size-text",
        ["-c", "import multigpu as mg; mg.init()"],
        "WORLD_SIZE='abc' is not an integer",
        env={"RANK": "0", "WORLD_SIZE": "abc"},
        python=True,
    ),
    Case(
        "env-rank-outside",
        ["-c", "import multigpu as mg; mg.init()"],
        "rank 5 is outside world size 2",
        env={"RANK": "5", "WORLD_SIZE": "2", "MASTER_PORT": "29999"},
        python=True,
    ),
    Case(
        "env-slurm-nodelist",
        ["-c", "import multigpu as mg; mg.init()"],
        "unbalanced brackets",
        env={
            "SLURM_PROCID": "0",
            "SLURM_STEP_ID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "n[1-2",
        },
        python=True,
    ),
    Case(
        "env-slurm-tasks",
        ["-c", "import multigpu as mg; mg.init()"],
        "cannot parse SLURM_TASKS_PER_NODE",
        env={
            "SLURM_PROCID": "0",
            "SLURM_STEP_ID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_TASKS_PER_NODE": "2(x",
        },
        python=True,
    ),
    Case(
        "env-devices-per-proc",
        ["-c", "import multigpu as mg; mg.init()"],
        "devices_per_process=0 is invalid",
        env={"MULTIGPU_JOB": '{"workers": {"devices_per_process": 0}}'},
        python=True,
    ),
]


def _snapshot(root: Path, skip: Path, ignore: tuple[str, ...] = ()) -> dict[str, tuple[int, int]]:
    found = {}
    for path in root.rglob("*"):
        if skip == path or skip in path.parents or (path.parent == root and path.name in ignore):
            continue
        stat = path.lstat()
        found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


def test_the_table_is_large_and_unique():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


#: A case still running after this long is a hang: it is killed and the test fails. 120 s is over 5 times
#: what the slowest case took on this 2-core machine beside a second suite (a new interpreter that imports
#: torch and trains a step: 16 s), so that a busy machine is never read as a hang.
HANG_S = 120
#: The promise "fast", in CPU seconds of the case and of every process it waited for: CPU, not wall time,
#: since the time a case waits for a core on a loaded machine is not the product's, while a case that waits
#: on its own (a socket, a lock, a FIFO) shows as a hang above. Over 5 times the most a case takes (5.5 s).
FAST_CPU_S = 30


class CaseServer:
    """``python -m multigpu ARGS`` through tests/scripts/case_server.py: one interpreter with torch
    imported, forked per case (the table's time was mostly interpreter starts and imports)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [PY, str(SCRIPTS / "case_server.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=str(REPO),
        )

    def run(
        self, argv: list[str], cwd: Path, env: dict, timeout: float, python: bool = False
    ) -> tuple[subprocess.CompletedProcess, float]:
        """``python -m multigpu ARGV``, or with ``python``: ``python ARGV``; and its CPU seconds."""
        out, err = cwd.parent / "case.stdout", cwd.parent / "case.stderr"
        request = {
            "argv": argv,
            "cwd": str(cwd),
            "env": env,
            "out": str(out),
            "err": str(err),
            "timeout": timeout,
            "python": python,
        }
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if reply["status"] == -9:
            raise subprocess.TimeoutExpired(argv, timeout)
        return subprocess.CompletedProcess(
            argv, reply["status"], out.read_text(errors="replace"), err.read_text(errors="replace")
        ), reply["cpu_s"]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_fresh(argv: list[str], cwd: Path, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """``argv`` as a process of its own, its output in files beside ``cwd`` (as CaseServer's); its status and
    the CPU seconds of it and of the processes it waited for (``os.wait4``: only this child's, where a
    difference of RUSAGE_CHILDREN would also count any earlier child that Popen reaps meanwhile)."""
    out, err = cwd.parent / "case.stdout", cwd.parent / "case.stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + HANG_S
    while not (done := os.wait4(proc.pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            os.wait4(proc.pid, 0)
            proc.returncode = -9
            raise subprocess.TimeoutExpired(argv, HANG_S)
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(done[1])
    cpu = done[2].ru_utime + done[2].ru_stime
    return subprocess.CompletedProcess(
        argv, proc.returncode, out.read_text(errors="replace"), err.read_text(errors="replace")
    ), cpu


@pytest.fixture(scope="module")
def case_server():
    server = CaseServer()
    yield server
    server.close()


# a case is killed at HANG_S; the margin is for its setup (a checkpoint to write)
@pytest.mark.timeout(HANG_S + 60)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case: Case, tmp_path: Path, case_server: CaseServer):
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "precious.txt").write_text("keep me")
    if case.setup is not None:
        case.setup(work)
    allowed = work / "out"
    before_outside = _snapshot(tmp_path, work, ignore=("case.stdout", "case.stderr"))
    before_inputs = _snapshot(work, allowed)
    env = child_env({"HOME": str(tmp_path), **case.env})
    try:
        if case.fresh:  # plain `python ...`: a real interpreter of its own
            proc, cpu = run_fresh([PY, *case.argv], work, env)
        else:
            proc, cpu = case_server.run(case.argv, work, env, timeout=HANG_S, python=case.python)
    finally:
        left = processes_with(str(work))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert cpu < FAST_CPU_S, f"{cpu:.1f} s of CPU\n{output}"
    assert "Traceback" not in output, output
    errors = [line for line in proc.stderr.splitlines() if line.startswith("multigpu: error:")]
    assert len(errors) == 1, output
    assert "HINT:" in errors[0] and case.expect in errors[0], output
    assert not left, f"processes left behind: {left}"
    assert not (work / PWNED).exists() and not (tmp_path / PWNED).exists(), (
        "the planted command ran"
    )
    assert _snapshot(tmp_path, work, ignore=("case.stdout", "case.stderr")) == before_outside, (
        "something outside the case folder changed"
    )
    after_inputs = _snapshot(work, allowed)
    changed = {k for k in before_inputs if after_inputs.get(k) != before_inputs[k]}
    assert not changed, f"input files changed or removed: {sorted(changed)}"
    created = sorted(set(after_inputs) - set(before_inputs))
    assert all(c.startswith(("outputs", "__pycache__")) or "__pycache__" in c for c in created), (
        created
    )


def test_a_privileged_port_as_non_root_is_one_line(monkeypatch):
    """``--master-port 80`` as a normal user: the bind fails with EACCES (simulated: the tests run as root)."""
    import errno
    import socket

    from multigpu.errors import LaunchError
    from multigpu.launch import ports

    class Refusing(socket.socket):
        def bind(self, address):
            raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(ports.socket, "socket", Refusing)
    with pytest.raises(LaunchError, match="port 80 needs root privileges"):
        ports.require_free_port(80)


def test_consolidating_a_checkpoint_folder_named_best_works(tmp_path):
    """The step comes from the manifest, not from the folder's name (was: int('best') crashed)."""
    from multigpu.checkpoint import sharded

    step = sharded_ckpt(tmp_path)
    best = tmp_path / "best"
    shutil.copytree(step, best)
    out = sharded.consolidate(best, tmp_path / "plain")
    assert out.name == "step-00000003" and (out / "state.pt").exists()
    state = torch.load(out / "state.pt", weights_only=True)
    model, _ = _tiny()
    model.load_state_dict(state["model"])


def test_the_python_hook_can_show_the_traceback(tmp_path):
    env = child_env({"RANK": "0", "MULTIGPU_TRACEBACK": "1"})
    proc = subprocess.run(
        [PY, "-c", "import multigpu as mg; mg.init()"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "WorldError" in proc.stderr


if __name__ == "__main__":  # pragma: no cover - list the cases
    for c in CASES:
        print(c.id)
    sys.exit(0)
