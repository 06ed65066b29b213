"""Issue 28, the attack side: one red case per failure class of the second outside audit.

Each case runs a real subprocess (``multigpu ...``, plain ``python`` or ``bash``) in a fresh folder
and asserts what a user is promised (docs/security.md):
- a non-zero exit with exactly one ``multigpu: error: ... HINT: ...`` line and no traceback
  (``outcome="error"``); or, where refusing is not the only safe answer (a planted link the command may
  ignore, a corrupt file it may skip), a success or that one line (``"any"``), a success (``"ok"``),
  or just no traceback (``"bounded"``: a queue that reports a failed run);
- fast (``fast_s``: 45 s of CPU unless said, the case's and its children's; a case still running after
  ``timeout``, 150 s of wall time unless said, is a hang) and bounded: an address-space limit
  (``RLIMIT_AS``) on the process and its children, and its peak resident memory below ``max_rss_mb``;
- nothing written, changed or deleted outside the output folder (a ``victim`` folder beside the
  case folder holds the files a planted link points at), inputs unchanged, no process left behind;
- no planted command ran (``PWNED``), no credential reached a server named by a file (a recorder
  on 127.0.0.1 only), no escape byte (ESC, C1) reached the output raw, no error line longer than
  1,000 characters (the issue asks for echoed values cut to about 80).

Run from a checkout's tests/ folder (conftest.py, test_hostile_inputs.py and test_hostile_checkpoints.py
beside it). Slurm cases put a fake ``srun``/``scontrol`` first on PATH: no case ever talks to a real Slurm
controller.

Cheap by construction: a 17-parameter Trainer script (``tiny.py``), ``tests/scripts/sleep_run.py``
for queue runs, ``examples/digits`` with ``max_steps: 2`` only where the recipe is the point.
Set ``DOORS_REPORT=/path/file.jsonl`` to get one JSON line per case (exit, time, memory, first lines).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import pickle
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import Callable, Optional

import pytest
import yaml
from conftest import PY, REPO, SCRIPTS, child_env, kill_all
from test_hostile_checkpoints import (
    deep_tuple_in,
    metadata_deep_key,
    read_metadata,
    rezip,
    write_metadata,
)
from test_hostile_inputs import edit_manifest, refresh_entry, replicated_ckpt, sharded_ckpt

pytestmark = pytest.mark.timeout(420)  # the longest case's timeout (300 s) and its setup
SLEEP = str(SCRIPTS / "sleep_run.py")
DIGITS = str(REPO / "examples" / "digits" / "train.py")
PWNED = "PWNED"
SECRET = "deadbeef" * 5  # 40 characters: the shape of a W&B API key
STEP = "ckpt/step-00000003"
# ESC, C1 controls, and raw C1 bytes that are not UTF-8
ESCAPES = re.compile("[\x1b\x80-\x9f\udc80-\udc9f]")

# ------------------------------------------------------------------------------- what a case is


@dataclass
class Ctx:
    """What a setup gets: the case folder (cwd of the command), the victim folder beside it, the
    credential recorder's port (0: none) and the environment the command will run with."""

    work: Path
    victim: Path
    port: int
    env: dict

    def multigpu(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PY, "-m", "multigpu", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=self.work,
        )


#: A planted FIFO must not make a command wait: a case that plants one is killed, and fails as a hang, after
#: 90 s - 5 times the slowest such case beside a second suite (18 s); load does not make a blocked wait longer.
FIFO_HANG_S = 90.0


@dataclass
class Case:
    id: str
    # "multigpu" arguments; python=True: plain `python` arguments; raw=True: the whole command
    argv: list
    expect: str = ""  # a fragment of the one error line (outcome "error")
    setup: Optional[Callable[[Ctx], None]] = None
    env: dict = field(default_factory=dict)
    python: bool = False
    raw: bool = False
    outcome: str = "error"  # "error", "any", "ok", "bounded" or "run-error"
    # The promise "fast", in CPU seconds of the case and of its children: not wall time, since the time a case
    # waits for a core on a loaded machine is not the product's; a case that waits on its own (a FIFO, a
    # socket) shows as a hang instead (timeout). 5 times the most a case uses (9 s: importing mlflow).
    fast_s: float = 45.0
    # When the case is killed, and fails as a hang: over 5 times the wall time of the slowest case on this
    # 2-core machine beside a second suite (28 s), so that a busy machine is never read as a hang.
    timeout: float = 150.0
    mem_gb: float = 3.0  # RLIMIT_AS of the process (inherited by its children)
    max_rss_mb: float = 1500.0
    # input folders (under work) where nothing may change, go or appear; None: all but out/
    readonly: Optional[tuple] = None
    # paths (under a readonly folder) a command may create there: a dry run's job script
    adds: tuple = ()
    recorder: bool = False  # start the credential recorder on 127.0.0.1
    check: Optional[Callable[["Ctx", "Result"], None]] = None  # further promises
    env_fn: Optional[Callable[[Ctx], dict]] = None  # environment computed from the context


@dataclass
class Result:
    code: Optional[int]
    stdout: str
    stderr: str
    elapsed: float
    cpu_s: float
    max_rss_mb: float
    timed_out: bool
    requests: list

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


# ------------------------------------------------------------------------------- files the cases use

TINY = """\
import sys, torch, multigpu as mg
from torch import nn
from torch.utils.data import TensorDataset
from multigpu import config
# key=value settings (also trainer.key=value) through the Python API: Trainer(**settings)
settings = {k.removeprefix("trainer."): v for k, v in config.parse_overrides(sys.argv[1:]).items()}
class Tiny(mg.Trainer):
    def compute_loss(self, batch):
        return nn.functional.mse_loss(self.model(batch[0]), batch[1])
run = mg.init(seed=0)
data = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
model = nn.Sequential(nn.Linear(2, 4), nn.GELU(), nn.Linear(4, 1))
Tiny(run, model, lambda p: torch.optim.SGD(p, lr=0.1),
     **{"batch_size": 4, "progress": False, "plot": False, **settings}).fit(data)
"""

HF_SCRIPT = """\
import os, sys
from huggingface_hub import HfApi
out = dict(a.split("=", 1) for a in sys.argv[1:])["out_dir"]
os.makedirs(out, exist_ok=True)
HfApi().whoami()  # a recipe that checks who it downloads as (HF_TOKEN from the user's shell)
"""

# the digits recipe, tiny: 2 optimizer steps, everything under out/
DIGITS_TINY = {
    "data": {"folder": "out/data"},
    "trainer": {
        "epochs": 1,
        "max_steps": 2,
        "batch_size": 64,
        "out_dir": "out/run",
        "progress": False,
        "plot": False,
    },
}
DIGITS_ARGS = [
    "data.folder=out/data",
    "trainer.max_steps=2",
    "trainer.batch_size=64",
    "trainer.out_dir=out/run",
    "trainer.progress=false",
    "trainer.plot=false",
]


def write(name: str, text, mode: int = 0o644) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        path = ctx.work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
        path.chmod(mode)

    return setup


def chain(*setups: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        for step in setups:
            step(ctx)

    return setup


def tiny() -> Callable[[Ctx], None]:
    return write("tiny.py", TINY)


def hparams(extra: dict) -> Callable[[Ctx], None]:
    data = json.loads(json.dumps(DIGITS_TINY))
    for key, value in extra.items():
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return write("h.yaml", yaml.safe_dump(data, sort_keys=False, width=10**9))


def runs_file(runs: dict) -> Callable[[Ctx], None]:
    """runs.yaml from a mapping; ``{work}``, ``{victim}`` and ``{port}`` in strings are filled in."""

    def setup(ctx: Ctx) -> None:
        def fill(value):
            if isinstance(value, str):
                return (
                    value.replace("{work}", str(ctx.work))
                    .replace("{victim}", str(ctx.victim))
                    .replace("{port}", str(ctx.port))
                )
            if isinstance(value, dict):
                return {fill(k): fill(v) for k, v in value.items()}
            if isinstance(value, list):
                return [fill(v) for v in value]
            return value

        (ctx.work / "runs.yaml").write_text(
            yaml.safe_dump(fill(runs), sort_keys=False, width=10**9)
        )

    return setup


def tiny_run(
    overrides: Optional[dict] = None, env: Optional[dict] = None, script: str = "{work}/tiny.py"
) -> dict:
    run = {"script": script, "out_dir_key": "out_dir", "overrides": overrides or {}}
    if env:
        run["env"] = env
    return {"a": run}


def sleep_run(**extra) -> dict:
    return {"a": {"script": SLEEP, "args": ["0"], "out_dir_key": "out_dir", **extra}}


QUEUE = ["queue", "runs.yaml", "--slots", "1", "--out", "out", "--no-live"]


def fingerprint(ctx: Ctx) -> str:
    from multigpu.queue.runs import load_runs

    return load_runs(ctx.work / "runs.yaml")[0].fingerprint()


def status_json(make: Callable[[str], str]) -> Callable[[Ctx], None]:
    """out/a/status.json with this run's own fingerprint (so the queue trusts it)."""

    def setup(ctx: Ctx) -> None:
        (ctx.work / "out" / "a").mkdir(parents=True, exist_ok=True)
        (ctx.work / "out" / "a" / "status.json").write_text(
            make(fingerprint(ctx)), encoding="utf-8", errors="surrogatepass"
        )

    return setup


def fifo(name: str) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        path = ctx.work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)

    return setup


def link(name: str, target: str) -> Callable[[Ctx], None]:
    """``work/name`` -> ``target`` (``{victim}``: the victim folder outside the case folder)."""

    def setup(ctx: Ctx) -> None:
        path = ctx.work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target.replace("{victim}", str(ctx.victim)))

    return setup


def run_with_metrics(
    folder: str,
    metrics: str = "step,epoch,train_loss,valid_loss,valid_accuracy\n"
    "1,1,0.9,0.8,0.5\n2,2,0.7,0.6,0.6\n",
    steps: Optional[str] = "step,epoch,loss\n1,0.5,0.9\n2,1,0.7\n",
) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        path = ctx.work / folder
        path.mkdir(parents=True, exist_ok=True)
        if metrics is not None:
            (path / "metrics.csv").write_text(metrics)
        if steps is not None:
            (path / "steps.csv").write_text(steps)

    return setup


def raw_dir_with_metrics(name: bytes) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        folder = os.path.join(bytes(ctx.work / "q"), name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, b"metrics.csv"), "w") as handle:
            handle.write("step,epoch,valid_loss,valid_accuracy\n1,1,0.5,0.1\n2,2,0.4,0.2\n")

    return setup


# ---------------------------------------------------------------- forged checkpoints (allow-listed classes only)

# The forges both files need (a deep tuple in a pickle, a zip rewritten record by record, .metadata read and
# written back with the manifest vouching for it) are tests/test_hostile_checkpoints.py's.


def in_work(forge: Callable[[Path], None]) -> Callable[[Ctx], None]:
    """A forge of tests/test_hostile_checkpoints.py (it takes a folder) as a setup: its checkpoint in the case folder."""

    def setup(ctx: Ctx) -> None:
        forge(ctx.work)

    return setup


class _LongPath:
    """Pickles as ``PosixPath(s, s, ..., s)``: 2,000 references to one 1-MiB string (about 1 MB of file)."""

    def __reduce__(self):
        import pathlib

        return (pathlib.PosixPath, tuple(["a" * (1 << 20)] * 2000))


def metadata_long_path(ctx: Ctx) -> None:
    step = sharded_ckpt(ctx.work)
    metadata = read_metadata(step)
    info = next(iter(metadata.storage_data.values()))
    object.__setattr__(info, "relative_path", _LongPath())
    write_metadata(step, pickle.dumps(metadata, protocol=2))


def metadata_repeated_chunk(ctx: Ctx) -> None:
    step = sharded_ckpt(ctx.work)
    metadata = read_metadata(step)
    entry = metadata.state_dict_metadata["model.0.weight"]
    entry.chunks = [entry.chunks[0]] * 200_000  # one object, memoised: ~1 MB of pickle
    write_metadata(step, pickle.dumps(metadata, protocol=2))


def _bad_newest_checkpoint(ctx: Ctx, make_state: Callable[[Path], None]) -> None:
    """out/checkpoints with a good step 1 of tiny.py's model and optimizer, and a step 9 whose manifest
    verifies but whose state.pt is forged: the run must skip 9 like a torn checkpoint and resume from 1
    (a run that started over would pass the other promises too)."""
    import torch
    from torch import nn

    from multigpu.checkpoint import files

    model = nn.Sequential(nn.Linear(2, 4), nn.GELU(), nn.Linear(4, 1))  # as in TINY
    good = {
        "model": model.state_dict(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(),
        "trainer": {"epoch": 0, "batch_in_epoch": 1, "global_step": 1},
    }
    files.save_state(ctx.work / "out" / "checkpoints", 1, good)
    step = files.save_state(ctx.work / "out" / "checkpoints", 9, {"XXDEEPKEYXX": 1})
    make_state(step / "state.pt")
    refresh_entry(step, "state.pt")


def deep_state_pt(ctx: Ctx) -> None:
    _bad_newest_checkpoint(
        ctx,
        lambda pt: rezip(
            pt,
            lambda name, data: (
                deep_tuple_in(data, "XXDEEPKEYXX") if name.endswith("/data.pkl") else data
            ),
        ),
    )


def deflated_state_pt(ctx: Ctx, elements: int = 256 << 20) -> None:
    """A 1 GiB tensor of zeros stored as a deflated zip record: about 1 MB on disk."""
    import collections

    import torch

    storage = object()

    class Rebuild:
        def __reduce__(self):
            return (
                torch._utils._rebuild_tensor_v2,
                (storage, 0, (elements,), (1,), False, collections.OrderedDict()),
            )

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", elements) if obj is storage else None

    def make(pt: Path) -> None:
        buffer = io.BytesIO()
        Pickler(buffer, protocol=2).dump({"model": {"w": Rebuild()}})
        with zipfile.ZipFile(pt, "w") as out:
            out.writestr(zipfile.ZipInfo("archive/data.pkl"), buffer.getvalue())
            out.writestr(zipfile.ZipInfo("archive/byteorder"), b"little")
            record = zipfile.ZipInfo("archive/data/0")
            record.compress_type = zipfile.ZIP_DEFLATED
            with out.open(record, "w", force_zip64=True) as handle:
                zeros, left = bytes(1 << 20), elements * 4
                while left:
                    handle.write(zeros[: min(left, len(zeros))])
                    left -= min(left, len(zeros))
            out.writestr(zipfile.ZipInfo("archive/version"), b"3")

    _bad_newest_checkpoint(ctx, make)


def checkpoints_with_leftovers(ctx: Ctx) -> None:
    """A sharded step-3 beside what a crash left: two '.old-step-*' folders and a '.tmp-step-*' draft.
    Recovery would delete one, rename the other and clear the draft - which a read-only command must not
    do to its source."""
    sharded_ckpt(ctx.work)
    for name in (
        ".old-step-00000003-deadbeef",
        ".old-step-00000002-deadbeef",
        ".tmp-step-00000004-cafe0000",
    ):
        (ctx.work / "ckpt" / name).mkdir()
        (ctx.work / "ckpt" / name / "kept.txt").write_text("evidence")


def manifest_with_c1_name(ctx: Ctx) -> None:
    step = replicated_ckpt(ctx.work)
    edit_manifest(
        step,
        lambda m: m["files"].__setitem__("x\u009b2J\u009d0;PWN", {"size": 1, "crc32": "00000000"}),
    )


def victim_checkpoints(ctx: Ctx) -> None:
    (ctx.victim / "ckpts" / "step-00000001").mkdir(parents=True)
    (ctx.victim / "ckpts" / "step-00000001" / "precious.bin").write_text(
        "someone else's checkpoint"
    )
    (ctx.work / "out").mkdir()
    (ctx.work / "out" / "checkpoints").symlink_to(ctx.victim / "ckpts")


FAKE_SCONTROL = """#!/bin/sh
if [ "$2" = hostnames ]; then echo n1; exit 0; fi
echo "slurm_load_jobs error: Invalid job id specified" >&2
exit 1
"""


def fake_slurm(ctx: Ctx) -> None:
    """bin/ with a fake srun and scontrol (first on PATH through ``slurm_env``): a case never reaches a real
    Slurm controller - nor, through it, the network - on a machine where the Slurm client is installed."""
    bin_dir = ctx.work / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (
        ("srun", "#!/bin/sh\nexit 0\n"),
        ("scontrol", FAKE_SCONTROL),
        ("sbatch", "#!/bin/sh\nexit 1\n"),
        ("scancel", "#!/bin/sh\nexit 1\n"),
    ):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)


def slurm_job_with_linked_tmp(ctx: Ctx) -> None:
    """`queue --slurm --dry-run` writes out/a/job.sbatch; a fake srun/scontrol let bash run it as Slurm would."""
    runs_file(sleep_run())(ctx)
    fake_slurm(ctx)
    ctx.env.update(slurm_env(ctx))
    done = ctx.multigpu("queue", "runs.yaml", "--slurm", "--dry-run", "--out", "out")
    assert done.returncode == 0, done.stdout + done.stderr
    (ctx.work / "out" / "a" / "status.json.tmp").symlink_to(ctx.victim / "precious.txt")


def slurm_env(ctx: Ctx) -> dict:
    return {
        "PATH": f"{ctx.work / 'bin'}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_NUM_NODES": "1",
    }


def run_folder_of_older_settings(ctx: Ctx) -> None:
    runs_file(sleep_run())(ctx)
    fake_slurm(ctx)
    folder = ctx.work / "out" / "a"
    folder.mkdir(parents=True)
    (folder / "status.json").write_text(
        json.dumps({"state": "done", "fingerprint": "0123456789abcdef"})
    )
    (folder / "metrics.csv").write_text("epoch,valid_score\n1,0.5\n")


def huge_runs_file(ctx: Ctx) -> None:
    keys = "".join(f"    k{i}: 0\n" for i in range(20_000))
    children = "".join(f"c{i} < p: {{}}\n" for i in range(2_999))
    (ctx.work / "runs.yaml").write_text(
        f"p:\n  script: {SLEEP}\n  args: ['0']\n  out_dir_key: out_dir\n"
        f"  overrides:\n{keys}{children}c2999 < p: {{gpus: 0}}\n"
    )


# ------------------------------------------------------------------------------- further promises


def no_credential_sent(ctx: Ctx, result: Result) -> None:
    seen = []
    for method, path, auth in result.requests:
        decoded = ""
        if auth and auth.lower().startswith("basic "):
            try:
                decoded = base64.b64decode(auth.split(None, 1)[1]).decode(errors="replace")
            except ValueError:
                pass
        if SECRET in (auth or "") or SECRET in decoded:
            seen.append(f"{method} {path}")
    assert not seen, f"the user's credential was sent to a server named by the runs file: {seen}"


def victim_untouched(ctx: Ctx, result: Result) -> None:
    content = (ctx.victim / "precious.txt").read_bytes()
    assert content == b"keep me", f"the victim file now holds {content[:40]!r}"


def says(fragment: str, stream: str = "output") -> Callable[[Ctx, Result], None]:
    """``fragment`` in the output (``stream="stderr"``: where the one error line goes)."""

    def check(ctx: Ctx, result: Result) -> None:
        assert fragment in getattr(result, stream), f"expected {fragment!r} in the {stream}"

    return check


def exits_with(code: int, fragment: str) -> Callable[[Ctx, Result], None]:
    """The script's own failure: its status, and the launcher's report of it (not a crash of the launcher)."""

    def check(ctx: Ctx, result: Result) -> None:
        assert result.code == code and fragment in result.stderr, (
            f"exit {result.code}, expected {code} and {fragment!r}"
        )

    return check


def all_of(*checks: Callable[[Ctx, Result], None]) -> Callable[[Ctx, Result], None]:
    def check(ctx: Ctx, result: Result) -> None:
        for one in checks:
            one(ctx, result)

    return check


def _compile_payload(ctx: Ctx) -> str:
    """g++ reads -wrapper as a program to run every compiler stage under (torch.compile's C++ kernels)."""
    return f'native -wrapper \'/bin/sh,-c,touch {ctx.work}/{PWNED}; exec "$0" "$@"\''


def compile_hparams(ctx: Ctx) -> None:
    hparams({"trainer.compile": {"options": {"cpp.march": _compile_payload(ctx)}}})(ctx)


def compile_override(ctx: Ctx) -> None:
    hparams({})(ctx)
    value = yaml.safe_dump(
        {"options": {"cpp.march": _compile_payload(ctx)}}, default_flow_style=True, width=10**9
    )
    (ctx.work / "override.txt").write_text("trainer.compile=" + value.strip())


def compile_runs_file(ctx: Ctx) -> None:
    runs_file(
        {
            "a": {
                "script": DIGITS,
                "args": ["{work}/h.yaml"],
                "overrides": {
                    "data.folder": "{work}/out/a-data",
                    "trainer.compile": {"options": {"cpp.march": _compile_payload(ctx)}},
                },
            }
        }
    )(ctx)
    hparams({})(ctx)


def compile_tiny(ctx: Ctx) -> None:
    tiny()(ctx)
    value = yaml.safe_dump(
        {"options": {"cpp.march": _compile_payload(ctx)}}, default_flow_style=True, width=10**9
    )
    (ctx.work / "override.txt").write_text("compile=" + value.strip())


def from_file(name: str) -> str:
    return f"@{name}"  # argv entries starting with @ are read from that file of the case folder


LONG = "x" * (3 << 20)  # 3 MB
RESUMED_PAST_STEP_9 = all_of(
    says("skipping checkpoint step-00000009"), says("resumed from"), says("step 1)")
)


# ----------------------------------------------------------------------------------------- the table

CASES = [
    # ---- code execution: torch.compile options reach g++'s command line (shlex-split, -wrapper runs a program)
    Case(
        "compile-options-hparams",
        [DIGITS, "h.yaml"],
        "compile",
        compile_hparams,
        python=True,
        timeout=240,
    ),
    Case(
        "compile-options-key-value",
        [DIGITS, "h.yaml", from_file("override.txt")],
        "compile",
        compile_override,
        python=True,
        timeout=240,
    ),
    Case(
        "compile-options-runs-file",
        QUEUE,
        "compile option 'cpp.march'",
        compile_runs_file,
        timeout=300,
        outcome="run-error",
    ),
    Case(
        "compile-options-python-api",
        ["tiny.py", "out_dir=out", from_file("override.txt")],
        "compile",
        compile_tiny,
        python=True,
        timeout=240,
    ),
    # ---- credentials: a runs file names the endpoint, the user's shell holds the token
    Case(
        "env-wandb-base-url",
        QUEUE,
        "WANDB_BASE_URL",
        chain(
            tiny(),
            runs_file(
                tiny_run(
                    {"loggers": ["wandb"]},
                    {"WANDB_BASE_URL": "http://127.0.0.1:{port}", "WANDB_MODE": "online"},
                )
            ),
        ),
        env={"WANDB_API_KEY": SECRET},
        recorder=True,
        check=no_credential_sent,
    ),
    Case(
        "env-mlflow-uri-and-token",
        QUEUE,
        "MLFLOW_TRACKING_URI",
        chain(
            tiny(),
            runs_file(
                tiny_run(
                    {"loggers": ["mlflow"]}, {"MLFLOW_TRACKING_URI": "http://127.0.0.1:{port}"}
                )
            ),
        ),
        env={"MLFLOW_TRACKING_TOKEN": SECRET},
        recorder=True,
        check=no_credential_sent,
    ),
    Case(
        "env-hf-endpoint-and-token",
        QUEUE,
        "HF_ENDPOINT",
        chain(
            write("hf.py", HF_SCRIPT),
            runs_file(
                tiny_run(env={"HF_ENDPOINT": "http://127.0.0.1:{port}"}, script="{work}/hf.py")
            ),
        ),
        env={"HF_TOKEN": SECRET},
        recorder=True,
        check=no_credential_sent,
    ),
    # ---- a runs file writes outside the output folder through library variables
    Case(
        "env-torch-logs-out",
        QUEUE,
        "TORCH_LOGS_OUT",
        chain(tiny(), runs_file(tiny_run(env={"TORCH_LOGS_OUT": "{victim}/torch_logs.txt"}))),
    ),
    Case(
        "env-mkl-verbose-output-file",
        QUEUE,
        "MKL_VERBOSE",
        chain(
            tiny(),
            runs_file(
                tiny_run(env={"MKL_VERBOSE": "1", "MKL_VERBOSE_OUTPUT_FILE": "{victim}/mkl.txt"})
            ),
        ),
    ),
    Case(
        "env-mlflow-file-store-outside",
        QUEUE,
        "MLFLOW_TRACKING_URI",
        chain(
            tiny(),
            runs_file(
                tiny_run(
                    {"loggers": ["mlflow"]},
                    {
                        "MLFLOW_TRACKING_URI": "file://{victim}/mlruns",
                        "MLFLOW_ALLOW_FILE_STORE": "true",
                    },
                )
            ),
        ),
    ),
    Case(
        "runs-out-dir-key-null",
        QUEUE,
        "is outside this queue run's folder",
        chain(
            tiny(),
            runs_file(
                {
                    "a": {
                        "script": "{work}/tiny.py",
                        "out_dir_key": None,
                        "overrides": {"trainer.out_dir": "{victim}/written-here"},
                    }
                }
            ),
        ),
        outcome="run-error",
    ),
    # ---- links planted in an output folder someone gave you
    # the save stops with one line naming the link: neither written through it nor pruned there
    Case(
        "link-checkpoints-to-victim",
        ["tiny.py", "out_dir=out", "keep_last=1"],
        "link",
        chain(tiny(), victim_checkpoints),
        python=True,
    ),
    Case(
        "link-curves-tmp-plot",
        ["plot", "out/run"],
        "",
        chain(
            run_with_metrics("out/run"), link("out/run/curves.png.tmp.png", "{victim}/precious.txt")
        ),
        outcome="any",
        check=victim_untouched,
    ),
    Case(
        "link-curves-tmp-end-of-fit",
        ["tiny.py", "out_dir=out", "plot=true"],
        "",
        chain(tiny(), link("out/curves.png.tmp.png", "{victim}/precious.txt")),
        python=True,
        outcome="any",
        check=victim_untouched,
    ),
    Case(
        "link-rank-stderr-log",
        ["run", "--log-dir", "out/logs", "s.py"],
        "",
        chain(
            write("s.py", "import sys\nprint('a line for the log', file=sys.stderr)\n"),
            link("out/logs/rank0.attempt0.stderr", "{victim}/precious.txt"),
        ),
        outcome="any",
        check=victim_untouched,
    ),
    Case(
        "link-rank-stdout-log",
        ["run", "--log-dir", "out/logs", "s.py"],
        "",
        chain(
            write("s.py", "print('a line for the log')\n"),
            link("out/logs/rank0.attempt0.stdout", "{victim}/precious.txt"),
        ),
        outcome="any",
        check=victim_untouched,
    ),
    Case(
        "link-tensorboard-folder",
        ["tiny.py", "out_dir=out", "loggers=[tensorboard]"],
        "",
        chain(tiny(), link("out/tensorboard", "{victim}")),
        python=True,
        outcome="any",
    ),
    Case(
        "link-slurm-status-tmp",
        ["bash", "out/a/job.sbatch"],
        "",
        slurm_job_with_linked_tmp,
        raw=True,
        outcome="any",
        env_fn=slurm_env,
        check=victim_untouched,
    ),
    # ---- commands that must not change their input
    Case(
        "consolidate-recovers-its-source",
        ["checkpoint", "consolidate", "ckpt", "--out", "out"],
        "",
        checkpoints_with_leftovers,
        outcome="ok",
        readonly=("ckpt",),
    ),
    Case(
        "queue-slurm-dry-run-renames",
        ["queue", "runs.yaml", "--slurm", "--dry-run", "--out", "out"],
        "",
        run_folder_of_older_settings,
        outcome="any",
        readonly=("out/a",),
        adds=("job.sbatch",),
        env_fn=slurm_env,
    ),
    # ---- resource exhaustion from a received checkpoint (allow-listed DCP classes only)
    Case(
        "metadata-long-path",
        ["checkpoint", "consolidate", STEP, "--out", "out"],
        "refused before loading",
        metadata_long_path,
        max_rss_mb=800,
    ),
    Case(
        "metadata-repeated-chunk",
        ["checkpoint", "consolidate", STEP, "--out", "out"],
        "more than 65,536 chunks",
        metadata_repeated_chunk,
        max_rss_mb=800,
    ),
    Case(
        "metadata-deep-tuple-key",
        ["checkpoint", "consolidate", STEP, "--out", "out"],
        "nests deeper than",
        in_work(metadata_deep_key),
        max_rss_mb=800,
    ),
    # the forged newest checkpoint is skipped like a torn one, and the run goes on from the good step 1, pruning
    # as it saves (keep_last=1) beside the skipped step 9. What these cases bound is memory and the skip itself.
    Case(
        "state-pt-deep-pickle-resume",
        ["tiny.py", "out_dir=out", "keep_last=1", "epochs=3"],
        "",
        chain(tiny(), deep_state_pt),
        python=True,
        outcome="ok",
        check=RESUMED_PAST_STEP_9,
    ),
    Case(
        "state-pt-deflated-record-resume",
        ["tiny.py", "out_dir=out", "keep_last=1", "epochs=3"],
        "",
        chain(tiny(), deflated_state_pt),
        python=True,
        outcome="ok",
        max_rss_mb=800,
        check=RESUMED_PAST_STEP_9,
    ),
    Case(
        "plot-metrics-fifo",
        ["plot", "run", "--out", "out/c.png"],
        "",
        chain(run_with_metrics("run", None), fifo("run/metrics.csv")),
        outcome="any",
        timeout=FIFO_HANG_S,
    ),
    Case(
        "plot-metrics-dev-zero",
        ["plot", "run", "--out", "out/c.png"],
        "",
        chain(run_with_metrics("run", None), link("run/metrics.csv", "/dev/zero")),
        outcome="any",
        max_rss_mb=800,
    ),
    Case(
        "queue-status-fifo",
        QUEUE,
        "",
        chain(runs_file(sleep_run()), fifo("out/a/status.json")),
        outcome="any",
        timeout=FIFO_HANG_S,
    ),
    Case(
        "queue-status-dev-zero",
        QUEUE,
        "",
        chain(runs_file(sleep_run()), link("out/a/status.json", "/dev/zero")),
        outcome="any",
        max_rss_mb=800,
    ),
    Case(
        "queue-log-fifo",
        QUEUE,
        "",
        chain(runs_file(sleep_run()), fifo("out/a/log.txt")),
        outcome="bounded",
        timeout=FIFO_HANG_S,
    ),
    Case(
        "queue-log-dev-zero",
        QUEUE,
        "",
        chain(runs_file(sleep_run()), link("out/a/log.txt", "/dev/zero")),
        outcome="bounded",
        max_rss_mb=800,
    ),
    Case(
        "queue-metrics-fifo-of-finished-run",
        QUEUE,
        "",
        chain(
            runs_file(sleep_run()),
            status_json(lambda fp: json.dumps({"state": "done", "fingerprint": fp})),
            fifo("out/a/metrics.csv"),
        ),
        outcome="any",
        timeout=FIFO_HANG_S,
    ),
    Case(
        "huge-runs-file",
        ["queue", "runs.yaml", "--slots", "1", "--out", "out"],
        "HINT",
        huge_runs_file,
        timeout=150,
    ),
    # ---- one line, never a traceback
    Case(
        "plot-name-mathtext",
        ["plot", "q", "--out", "out/c.png"],
        "",
        chain(run_with_metrics("q/a$\\foo$"), run_with_metrics("q/b")),
        outcome="any",
    ),
    Case(
        "plot-column-deep-sqrt",
        ["plot", "run", "--out", "out/c.png"],
        "",
        run_with_metrics(
            "run",
            "step,epoch,valid_loss,valid_$"
            + "\\sqrt{" * 400
            + "x"
            + "}" * 400
            + "$\n1,1,0.5,1\n2,2,0.4,2\n",
        ),
        outcome="any",
    ),
    Case(
        "plot-step-1e308",
        ["plot", "run", "--out", "out/c.png"],
        "",
        run_with_metrics("run", "step,epoch,valid_loss\n-1e308,1,0.5\n1e308,2,0.4\n", None),
        outcome="any",
    ),
    Case(
        "plot-non-utf8-names",
        ["plot", "q", "--out", "out/c.png"],
        "",
        chain(raw_dir_with_metrics(b"\xff\xfename"), raw_dir_with_metrics(b"ok")),
        outcome="any",
    ),
    Case(
        "queue-status-deep-json",
        QUEUE,
        "",
        chain(runs_file(sleep_run()), write("out/a/status.json", "[" * 100_000)),
        outcome="any",
    ),
    Case(
        "queue-status-started-text",
        QUEUE,
        "",
        chain(
            runs_file(sleep_run()),
            status_json(
                lambda fp: json.dumps(
                    {"state": "done", "fingerprint": fp, "started": "x", "ended": "y"}
                )
            ),
        ),
        outcome="any",
    ),
    Case("doctor-one-process", ["doctor", "--out", "out", "--timeout", "60"], "", outcome="any"),
    Case(
        "run-log-dir-stray-copy",
        ["run", "--log-dir", "out/logs", "s.py"],
        "",
        chain(
            write("s.py", "raise SystemExit(3)\n"),
            write("out/logs/rank0.attempt0 (copy).stderr", "old\n"),
        ),
        outcome="bounded",
        check=exits_with(3, "exited with code 3"),
    ),
    Case(
        "worker-num-workers-negative",
        [DIGITS, "h.yaml", "trainer.num_workers=-1"],
        "num_workers",
        hparams({}),
        python=True,
    ),
    Case(
        "worker-num-workers-negative-under-run",
        ["run", DIGITS, "h.yaml", "trainer.num_workers=-1"],
        "num_workers",
        hparams({}),
    ),
    Case("worker-lr-nan", [DIGITS, "h.yaml", "optim.lr=.nan"], "lr", hparams({}), python=True),
    Case(
        "worker-out-dir-surrogate",
        [DIGITS, "h.yaml"],
        "out_dir",
        write(
            "h.yaml",
            yaml.safe_dump(DIGITS_TINY).replace("out_dir: out/run", 'out_dir: "out/\\ud800"'),
        ),
        python=True,
    ),
    Case(
        "worker-bad-mlflow-uri",
        ["tiny.py", "out_dir=out", "loggers=[mlflow]"],
        "MLFLOW_TRACKING_URI",
        tiny(),
        env={"MLFLOW_TRACKING_URI": "::not-a-uri"},
        python=True,
    ),
    # MLflow reads a bare path as a file store in the working folder when file stores are allowed
    Case(
        "worker-mlflow-bare-path",
        ["tiny.py", "out_dir=out", "loggers=[mlflow]"],
        "MLFLOW_TRACKING_URI",
        tiny(),
        env={"MLFLOW_TRACKING_URI": "../victim/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"},
        python=True,
    ),
    Case(
        "worker-wandb-run-id-fifo",
        ["tiny.py", "out_dir=out", "loggers=[wandb]"],
        "",
        chain(tiny(), fifo("out/.wandb_run_id")),
        env={"WANDB_MODE": "offline"},
        python=True,
        outcome="any",
        timeout=FIFO_HANG_S,
    ),
    Case(
        "echo-3mb-value-hparams",
        [DIGITS, "h.yaml"],
        "model.hidden",
        hparams({"model.hidden": LONG}),
        python=True,
    ),
    Case("echo-3mb-value-runs-file", QUEUE, "gpus", runs_file(sleep_run(gpus=LONG))),
    # ---- escapes from files and folder names reach the terminal raw
    Case(
        "escapes-plot-folder-names",
        ["plot", "q", "--out", "out/c.png"],
        "",
        chain(run_with_metrics("q/a\x1b]0;PWN\x07"), run_with_metrics("q/b\u009b31m")),
        outcome="any",
    ),
    Case(
        "escapes-queue-status-state",
        QUEUE,
        "",
        chain(
            runs_file(sleep_run()),
            status_json(
                lambda fp: json.dumps(
                    {"state": "\x1b]0;PWN\x07 \u009b2J", "fingerprint": fp}, ensure_ascii=False
                )
            ),
        ),
        outcome="any",
    ),
    Case(
        "escapes-checkpoint-manifest-name",
        ["checkpoint", "verify", STEP],
        "not inside the checkpoint",
        # shown escaped: neither raw nor dropped
        manifest_with_c1_name,
        check=says("\\x9b", "stderr"),
    ),
    Case(
        "slurm-status-unicode-digits",
        ["slurm", "status", "\u0661\u0662\u0663"],
        "is not a Slurm job id",
        fake_slurm,
        env_fn=slurm_env,
    ),
    Case(
        "slurm-logs-fullwidth-digits",
        ["slurm", "logs", "\uff11\uff12\uff13"],
        "is not a Slurm job id",
        fake_slurm,
        env_fn=slurm_env,
    ),
]


# ------------------------------------------------------------------------------- running a case


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def _answer(self) -> None:
        self.seen.append((self.command, self.path, self.headers.get("Authorization")))
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(min(length, 1 << 20))
        body = b'{"error_code": "UNAUTHENTICATED", "message": "recorded by the test"}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


class Recorder:
    """An HTTP server on 127.0.0.1 only that answers 401 and records each request's Authorization header."""

    def __enter__(self) -> "Recorder":
        self.handler = type("Handler", (_Recorder,), {"seen": []})
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self.handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def requests(self) -> list:
        return list(self.handler.seen)


def _limits(mem_gb: float) -> Callable[[], None]:
    def preexec() -> None:
        os.setsid()  # its own process group: a timeout kills everything it started there
        limit = int(mem_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return preexec


def _drain(stream, sink: list, cap: int = 8 << 20) -> None:
    kept = 0
    for chunk in iter(lambda: stream.read1(1 << 16), b""):
        if kept < cap:
            sink.append(chunk[: cap - kept])
            kept += len(chunk)


def _ours(work: Path, session: int) -> list:
    """Pids of the case: in its session, or working in (or naming) its folder - queue runs have sessions of their own."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] == "Z":
                continue
            if int(stat[3]) == session:
                found.append(int(entry.name))
                continue
            cwd = os.readlink(entry / "cwd")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if str(work) in cmdline or cwd == str(work) or cwd.startswith(str(work) + "/"):
            found.append(int(entry.name))
    return found


def _peak_rss_mb(pid: int) -> float:
    """VmHWM of a process: its own peak after exec (ru_maxrss would count the forked pytest's pages too)."""
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def run_limited(command: list, cwd: Path, env: dict, timeout: float, mem_gb: float) -> tuple:
    """(exit status or None on timeout, stdout, stderr, seconds, CPU seconds of the process and of the
    children it waited for, the largest peak RSS in MB of any process of the case - sampled every 0.2 s)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_limits(mem_gb),
    )
    out: list = []
    err: list = []
    readers = [
        threading.Thread(target=_drain, args=(proc.stdout, out), daemon=True),
        threading.Thread(target=_drain, args=(proc.stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    code, peak, sampled = None, 0.0, 0.0
    while time.monotonic() - started < timeout:
        if time.monotonic() - sampled >= 0.2:
            sampled = time.monotonic()
            peak = max([peak, *(_peak_rss_mb(pid) for pid in _ours(cwd, proc.pid))])
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    if code is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        usage = os.wait4(proc.pid, 0)[2]
    proc.returncode = code if code is not None else -9
    for reader in readers:
        reader.join(timeout=5)
    decode = lambda chunks: b"".join(chunks).decode("utf-8", "surrogateescape")  # noqa: E731
    return code, decode(out), decode(err), elapsed, usage.ru_utime + usage.ru_stime, peak


def _snapshot(root: Path, skip: tuple = ()) -> dict:
    """Mode, size, modification time and, for a regular file, a SHA-256 of its bytes: a change that kept
    the size and the time still shows (FIFOs and device links are never opened)."""
    found = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        here = Path(folder)
        dirs[:] = [d for d in dirs if here / d not in skip]
        for name in dirs + files:
            path = here / name
            if path in skip:
                continue
            stat = path.lstat()
            digest = ""
            if S_ISREG(stat.st_mode):
                try:
                    digest = hashlib.sha256(path.read_bytes()).hexdigest()
                except OSError as exc:  # unreadable: its mode, size and time still count
                    digest = type(exc).__name__
            found[os.fsdecode(path.relative_to(root))] = (
                stat.st_mode,
                stat.st_size,
                stat.st_mtime_ns,
                digest,
            )
    return found


def _report(case: Case, result: Result, problems: list) -> None:
    path = os.environ.get("DOORS_REPORT")
    if not path:
        return
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in result.stderr.splitlines() if line.startswith("multigpu: error:")]
    trace = result.output.find("Traceback")
    record = {
        "id": case.id,
        "code": result.code,
        "timed_out": result.timed_out,
        "seconds": round(result.elapsed, 1),
        "cpu_s": round(result.cpu_s, 1),
        "max_rss_mb": round(result.max_rss_mb),
        "error_lines": len(errors),
        "first_error": errors[0][:300] if errors else None,
        "longest_error": max(map(len, errors), default=0),
        "traceback_tail": (
            [line for line in result.output[trace:].splitlines() if line.strip()][-1][:300]
            if trace >= 0
            else None
        ),
        "last_line": lines[-1][:300] if lines else None,
        "requests": len(result.requests),
        "problems": problems,
    }
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, ensure_ascii=True) + "\n")


def test_the_table_covers_every_failure_class():
    assert len(CASES) >= 45
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def shared_mpl(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mplconfig")  # matplotlib's font cache, built once


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_door(case: Case, tmp_path: Path, shared_mpl: Path):
    work, victim, scratch = tmp_path / "work", tmp_path / "victim", tmp_path / "scratch"
    for folder in (
        work,
        victim,
        scratch / "home",
        scratch / "tmp",
        scratch / "inductor",
        scratch / "cache",
    ):
        folder.mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    env = child_env(
        {
            "HOME": str(scratch / "home"),
            "TMPDIR": str(scratch / "tmp"),
            "MPLCONFIGDIR": str(shared_mpl),
            "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
            "XDG_CACHE_HOME": str(scratch / "cache"),
            "WANDB_CONFIG_DIR": str(scratch / "cache"),
            "WANDB_CACHE_DIR": str(scratch / "cache"),
            "WANDB_DATA_DIR": str(scratch / "cache"),
            "WANDB_ERROR_REPORTING": "false",
            "HF_HOME": str(scratch / "cache"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    for name in (
        "WANDB_API_KEY",
        "WANDB_MODE",
        "WANDB_BASE_URL",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_TRACKING_TOKEN",
        "HF_TOKEN",
        "HF_ENDPOINT",
    ):
        env.pop(name, None)
    env.update(case.env)
    recorder = Recorder() if case.recorder else None
    port = recorder.__enter__().port if recorder else 0
    try:
        ctx = Ctx(work, victim, port, env)
        if case.setup is not None:
            case.setup(ctx)
        if case.env_fn is not None:
            env.update(case.env_fn(ctx))
        argv = [
            (work / a[1:]).read_text() if isinstance(a, str) and a.startswith("@") else a
            for a in case.argv
        ]
        command = (
            argv if case.raw else [PY, *argv] if case.python else [PY, "-m", "multigpu", *argv]
        )
        skip = (work, scratch)
        before_outside = _snapshot(tmp_path, skip)
        readonly = [work / p for p in case.readonly] if case.readonly is not None else None
        before_inputs = (
            {p: _snapshot(p) for p in readonly}
            if readonly is not None
            else {work: _snapshot(work, (work / "out",))}
        )
        try:
            code, stdout, stderr, elapsed, cpu, rss = run_limited(
                command, work, env, case.timeout, case.mem_gb
            )
        finally:
            # runs of a queue end by SIGTERM when it is gone: give them a moment
            deadline = time.monotonic() + 10
            while (left := _ours(work, -1)) and time.monotonic() < deadline:
                time.sleep(0.2)
            kill_all(left)
        result = Result(
            code,
            stdout,
            stderr,
            elapsed,
            cpu,
            rss,
            code is None,
            recorder.requests if recorder else [],
        )
    finally:
        if recorder:
            recorder.__exit__(None, None, None)

    problems = []

    def promise(ok: bool, text: str) -> None:
        if not ok:
            problems.append(text)

    output = result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("multigpu: error:")]
    promise(not result.timed_out, f"did not finish in {case.timeout:.0f} s (killed)")
    promise(
        result.cpu_s < case.fast_s,
        f"used {result.cpu_s:.1f} s of CPU (promise: under {case.fast_s:.0f} s)",
    )
    promise(result.code is None or result.code >= 0, f"killed by signal {-(result.code or 0)}")
    promise(
        "Traceback" not in output,
        "a traceback: "
        + (output[output.find("Traceback") :][:300] if "Traceback" in output else ""),
    )
    if case.outcome == "error":
        promise(result.code not in (0, None), f"exit {result.code} (promise: non-zero)")
        promise(len(errors) == 1, f"{len(errors)} 'multigpu: error:' lines (promise: exactly one)")
        promise(
            all("HINT:" in e and case.expect in e for e in errors[:1]),
            f"the error line lacks HINT/{case.expect!r}: {errors[:1]}",
        )
    elif case.outcome == "ok":
        promise(result.code == 0, f"exit {result.code} (promise: 0)")
        promise(not errors, f"error lines: {errors[:2]}")
    # the queue goes on and reports the run's own one line in its log tail
    elif case.outcome == "run-error":
        joined = re.sub(r"\n\s*", "", output)
        promise(result.code not in (0, None), f"exit {result.code} (promise: non-zero)")
        promise(
            "multigpu: error:" in joined and case.expect in joined and "HINT:" in joined,
            f"the run's one line ({case.expect!r}) is not in the queue's report",
        )
    elif case.outcome == "any":
        promise(
            result.code == 0 and not errors or result.code not in (0, None) and len(errors) == 1,
            f"exit {result.code} with {len(errors)} error line(s) (promise: 0, or non-zero with one line)",
        )
    promise(
        all(len(e) <= 1000 for e in errors),
        f"an error line of {max(map(len, errors), default=0):,} characters",
    )
    promise(
        result.max_rss_mb < case.max_rss_mb,
        f"peak RSS {result.max_rss_mb:.0f} MB (promise: under {case.max_rss_mb:.0f} MB)",
    )
    promise(not left, f"processes left behind: {left}")
    promise(
        not (work / PWNED).exists() and not (tmp_path / PWNED).exists(),
        "the planted command ran (PWNED exists)",
    )
    escapes = sorted({repr(c) for c in ESCAPES.findall(output)})
    promise(not escapes, f"escape/C1 characters reached the output raw: {escapes[:5]}")
    after_outside = _snapshot(tmp_path, skip)
    outside = sorted(
        k
        for k in set(before_outside) | set(after_outside)
        if before_outside.get(k) != after_outside.get(k)
    )
    promise(not outside, f"changed outside the case folder: {outside[:6]}")
    for root, before in before_inputs.items():
        after = _snapshot(root, (work / "out",)) if readonly is None else _snapshot(root)
        changed = sorted(k for k in before if after.get(k) != before[k])
        promise(not changed, f"inputs changed or removed under {root.name}: {changed[:6]}")
        created = sorted(k for k in set(after) - set(before) if "__pycache__" not in k)
        if readonly is None:
            promise(not created, f"written outside out/: {created[:6]}")
        else:
            created = [k for k in created if k not in case.adds]
            promise(not created, f"created under {root.name}: {created[:6]}")
    if case.check is not None:
        try:
            case.check(ctx, result)
        except AssertionError as exc:
            problems.append(str(exc).splitlines()[0][:300])
    _report(case, result, problems)
    assert not problems, (
        "\n".join(problems) + f"\n--- exit {result.code}, {result.elapsed:.1f} s "
        f"({result.cpu_s:.1f} s of CPU), {result.max_rss_mb:.0f} MB\n--- output (head)\n{output[:1500]}"
    )


if __name__ == "__main__":  # pragma: no cover - list the cases
    for c in CASES:
        print(c.id)
    sys.exit(0)
