"""Received checkpoints that try to exhaust memory, crash the interpreter, or reach outside their folder.

Each forged checkpoint uses only what the allow-lists admit (DCP's own metadata classes, a torch.save
zip), so only the limits of :mod:`multigpu.checkpoint.untrusted` and the file door stand in the way. Each
case runs a real process under an address-space limit (RLIMIT_AS 3 GB) and a timeout: the promise is one
``multigpu: error: ... HINT:`` line (or the checkpoint listed as corrupt), no traceback, no crash, fast -
never gigabytes or minutes. Plus: ``list`` and ``verify`` leave their input byte for byte unchanged, a
linked step folder is never listed nor pruned, and the scans admit every checkpoint we write.

The forges here are shared: tests/test_hostile_doors.py imports them and runs the launches that promise
more than this file would (forged .metadata and state.pt, ``consolidate`` beside a crash's leftovers,
escapes in a manifest's names, a planted ``checkpoints`` link): one process per forged input, not two.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import resource
import subprocess
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import PY, child_env
from torch import nn

pytestmark = pytest.mark.timeout(300)
STEP = "ckpt/step-00000003"
LIMIT_GB = 3


# ----------------------------------------------------------------------------------------- forging


def _tiny() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


def sharded_ckpt(folder: Path) -> Path:
    from multigpu.checkpoint import sharded

    model, opt = _tiny()
    return sharded.save(
        folder / "ckpt",
        3,
        model,
        opt,
        {"trainer": {"epoch": 1}},
        is_main=True,
        barrier=lambda: None,
        meta={"world_size": 1},
    )


def replicated_ckpt(folder: Path, name: str = "ckpt", step: int = 3) -> Path:
    from multigpu.checkpoint import files

    model, opt = _tiny()
    return files.save_state(
        folder / name, step, {"model": model.state_dict(), "optimizer": opt.state_dict()}
    )


def refresh(step: Path, name: str) -> None:
    """Make the manifest vouch for a forged file (as an attacker who rewrites both would)."""
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / name).read_bytes()
    import zlib

    manifest["files"][name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (step / "manifest.json").write_text(json.dumps(manifest))


def read_metadata(step: Path):
    return pickle.loads((step / ".metadata").read_bytes())  # our own fresh checkpoint: trusted here


def write_metadata(step: Path, data: bytes) -> None:
    (step / ".metadata").write_bytes(data)
    refresh(step, ".metadata")


def deep_tuple_in(pickled: bytes, marker: str, depth: int = 1_000_000) -> bytes:
    """Replace the protocol-2 string ``marker`` by a ``depth``-deep nested 1-tuple (2 bytes a level)."""
    raw = marker.encode()
    opcode = b"X" + len(raw).to_bytes(4, "little") + raw
    assert pickled.count(opcode) == 1
    return pickled.replace(opcode, b")" + b"\x85" * depth)


def metadata_deep_key(work: Path) -> None:
    step = sharded_ckpt(work)
    metadata = read_metadata(step)
    metadata.state_dict_metadata["XXDEEPKEYXX"] = metadata.state_dict_metadata["model.0.bias"]
    write_metadata(step, deep_tuple_in(pickle.dumps(metadata, protocol=2), "XXDEEPKEYXX"))


def metadata_overlapping_chunks(work: Path) -> None:
    """Two chunks of one tensor covering the same rows (and none covering the others): garbage on load."""
    step = sharded_ckpt(work)
    metadata = read_metadata(step)
    entry = metadata.state_dict_metadata["model.0.weight"]
    chunk = entry.chunks[0]
    half = type(chunk)(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))
    entry.chunks = [half, type(chunk)(offsets=torch.Size([1, 0]), sizes=torch.Size([2, 3]))]
    write_metadata(step, pickle.dumps(metadata, protocol=2))


def rezip(state_pt: Path, replace: Callable[[str, bytes], bytes]) -> None:
    """Rewrite a torch.save zip record by record (our files carry no record CRCs: read them raw)."""
    from multigpu.checkpoint.untrusted import read_zip_records

    with open(state_pt, "rb") as handle:
        records = read_zip_records(handle, state_pt.stat().st_size)
        contents = []
        for record in records:
            handle.seek(record.data_offset)
            contents.append((record.name, handle.read(record.size)))
    with zipfile.ZipFile(state_pt, "w") as out:
        for name, data in contents:
            out.writestr(zipfile.ZipInfo(name), replace(name, data))


def deep_extra_pt(work: Path) -> None:
    step = sharded_ckpt(work)
    buffer = io.BytesIO()
    torch.save({"XXDEEPKEYXX": 1}, buffer)
    (step / "extra.pt").write_bytes(buffer.getvalue())
    rezip(
        step / "extra.pt",
        lambda name, data: (
            deep_tuple_in(data, "XXDEEPKEYXX") if name.endswith("/data.pkl") else data
        ),
    )
    refresh(step, "extra.pt")


# ----------------------------------------------------------------------------------------- running


def _limited() -> None:
    limit = LIMIT_GB << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def cli(*argv: str) -> list:
    """``python -m multigpu ARGV`` with the test's token on its command line (found by ``no_leftovers``)."""
    return [
        "-c",
        "import sys; from multigpu.cli import main; sys.exit(main(sys.argv[2:]))",
        "{token}",
        *argv,
    ]


def run_limited(
    argv: list, work: Path, token: str, timeout: float = 60
) -> subprocess.CompletedProcess:
    argv = [token if a == "{token}" else a for a in argv]
    if argv[0] == "-c" and "{token}" not in argv and token not in argv:
        argv = [*argv, token]  # a script run with -c: the token is its (unused) argument
    return subprocess.run(
        [PY, *argv],
        cwd=work,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_limited,
    )


# The forged checkpoints a command refuses or a resume skips (a deep tuple key in .metadata, a 1 MiB string
# repeated 2,000 times, one chunk repeated 200,000 times, a deep pickle or a deflated 1 GiB record in a
# state.pt) run in tests/test_hostile_doors.py, which promises more of the same launch (its peak memory,
# time, nothing written outside the case folder): the cases here are the ones it has no twin for.
CASES = [
    # (id, argv, forge, outcome: "error" with this fragment in the one error line, or "listed" with it in stdout)
    (
        "metadata-overlapping-chunks",
        cli("checkpoint", "verify", STEP),
        metadata_overlapping_chunks,
        "error",
        "overlapping chunks",
    ),
    (
        "metadata-deep-tuple-key-listed",
        cli("checkpoint", "list", "ckpt"),
        metadata_deep_key,
        "listed",
        "CORRUPT",
    ),
    (
        "extra-pt-deep-pickle",
        cli("checkpoint", "verify", STEP),
        deep_extra_pt,
        "error",
        "nests deeper than",
    ),
]


@pytest.mark.parametrize(
    "case_id, argv, forge, outcome, fragment", CASES, ids=[c[0] for c in CASES]
)
def test_a_forged_checkpoint_is_one_line_or_listed_as_corrupt(
    tmp_path, case_id, argv, forge, outcome, fragment, no_leftovers
):
    forge(tmp_path)
    # timeout 60 s: a scan without its limits takes minutes
    proc = run_limited(argv, tmp_path, no_leftovers)
    output = proc.stdout + proc.stderr
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {output[-2000:]}"
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("multigpu: error:")]
    if outcome == "error":
        assert proc.returncode != 0 and len(errors) == 1, output[-3000:]
        assert "HINT:" in errors[0] and fragment in errors[0], errors[0]
        assert len(errors[0]) < 1000
    else:  # "listed": `checkpoint list` shows the forged step as corrupt and goes on
        assert proc.returncode == 0 and fragment in proc.stdout, output[-3000:]


def test_the_limits_admit_every_checkpoint_we_write(tmp_path):
    """The scans run on every load: our own files (sharded and replicated) must always pass them."""
    from multigpu.checkpoint import files

    for step in (sharded_ckpt(tmp_path), replicated_ckpt(tmp_path, "plain")):
        files.verify(step)  # contents=True: .metadata, extra.pt and state.pt scanned


def _shared_and_cyclic() -> dict:
    """Pickles of plain containers: the ones that share finished objects must pass, the cycles must not."""
    name = "".join(["valid", "_loss"])  # one str object, memoised once and fetched again
    inner: list = []
    looped: list = []
    looped.append(looped)
    outer: dict = {}
    outer["again"] = [outer]
    through: list = []
    through.append({"back": (through,)})
    return {
        # The tracker's state: a string shared between an outer dict still open and an inner one (the
        # CI failure of 2026-11-24: every checkpoint with a monitor was refused as "a cycle").
        "shared string": ({"monitor": name, "tracker": {"monitor": name, "best": 1.0}}, None),
        "shared list": ({"a": inner, "b": {"c": inner}, "d": [inner, inner]}, None),
        "list in itself": (looped, "make a cycle"),
        "dict in itself through a list": (outer, "make a cycle"),
        "list in itself through a dict and a tuple": (through, "make a cycle"),
    }


def test_a_list_appended_to_itself_by_dup_is_refused():
    """No pickler writes it (pickle writes GET): ``]`` empty list, ``2`` DUP, ``a`` APPEND, ``.`` STOP."""
    from multigpu.checkpoint.untrusted import scan_pickle
    from multigpu.errors import CheckpointError

    with pytest.raises(CheckpointError, match="make a cycle"):
        scan_pickle(b"]2a.", "dup")


@pytest.mark.parametrize("case", list(_shared_and_cyclic()))
def test_shared_objects_pass_and_cycles_are_refused(case):
    from multigpu.checkpoint.untrusted import scan_pickle
    from multigpu.errors import CheckpointError

    value, refused = _shared_and_cyclic()[case]
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        data = pickle.dumps(value, protocol=protocol)
        if refused is None:
            scan_pickle(data, case)
        else:
            with pytest.raises(CheckpointError, match=refused):
                scan_pickle(data, case)


# ----------------------------------------------------------------------------------------- read-only commands


def _fingerprint(root: Path) -> dict:
    found = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(folder) / name
            stat = path.lstat()
            digest = (
                hashlib.sha256(path.read_bytes()).hexdigest()
                if path.is_file() and not path.is_symlink()
                else ""
            )
            found[str(path.relative_to(root))] = (
                stat.st_mode,
                stat.st_size,
                stat.st_mtime_ns,
                digest,
            )
    return found


@pytest.mark.parametrize("argv", [["list", "ckpt"], ["verify", STEP]], ids=["list", "verify"])
def test_checkpoint_commands_never_change_their_input(tmp_path, argv, no_leftovers):
    """A crash left an .old-step copy (of a step that exists, and of one that does not) and a .tmp draft:
    a resume would fix them; the commands only read. (``consolidate`` on the same folder is
    ``consolidate-recovers-its-source`` in tests/test_hostile_doors.py.)"""
    sharded_ckpt(tmp_path)
    for name in (
        ".old-step-00000003-deadbeef",
        ".old-step-00000002-deadbeef",
        ".tmp-step-00000004-cafe0000",
    ):
        (tmp_path / "ckpt" / name).mkdir()
        (tmp_path / "ckpt" / name / "kept.txt").write_text("evidence")
    before = _fingerprint(tmp_path / "ckpt")
    # one process: seconds
    proc = run_limited(cli("checkpoint", *argv), tmp_path, no_leftovers, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _fingerprint(tmp_path / "ckpt") == before


# ----------------------------------------------------------------------------------------- planted links


def test_a_linked_step_folder_is_never_listed_nor_pruned(tmp_path):
    from multigpu.checkpoint import files

    elsewhere = replicated_ckpt(tmp_path, "elsewhere", step=7)
    replicated_ckpt(tmp_path, "ckpt", step=1)
    (tmp_path / "ckpt" / "step-00000007").symlink_to(elsewhere)
    assert [i.step for i in files.list_checkpoints(tmp_path / "ckpt")] == [1]
    files.save_state(tmp_path / "ckpt", 2, {"x": torch.ones(1)})
    files.prune(tmp_path / "ckpt", keep_last=1, newest=2)
    assert (elsewhere / "state.pt").exists()


@pytest.mark.parametrize("value", ["yes", 1, 0, None, [], {"a": 1}])
def test_a_manifest_s_optimizer_flat_must_be_true_or_false(tmp_path, value):
    """optimizer_flat chooses how the optimizer's shards are read: anything but a bool is a damaged folder."""
    from multigpu.checkpoint.reading import check_manifest
    from multigpu.errors import CheckpointError

    manifest = {"files": {"state.pt": {"size": 1, "xxh3": "0" * 16}}, "step": 1}
    for flat in (True, False):
        check_manifest({**manifest, "optimizer_flat": flat}, tmp_path)
    with pytest.raises(CheckpointError) as info:
        check_manifest({**manifest, "optimizer_flat": value}, tmp_path)
    assert "'optimizer_flat' is not true or false" in str(info.value) and "HINT:" in str(info.value)


def test_a_state_entry_that_cannot_be_pickled_names_its_key(tmp_path):
    """A lambda (or a lock, a generator) in the extra state was pickle's traceback; now one line naming it."""
    import threading

    from multigpu.checkpoint.files import save_state
    from multigpu.errors import CheckpointError

    model, _ = _tiny()
    for bad, key in (
        (lambda x: x, "extra.schedule"),
        (threading.Lock(), "extra.schedule"),
        ([1, {"deep": (x for x in ())}], "extra.schedule[1].deep"),
    ):
        with pytest.raises(CheckpointError) as info:
            save_state(
                tmp_path / "ckpt",
                3,
                {"model": model.state_dict(), "extra": {"epoch": 1, "schedule": bad}},
            )
        assert f"{key} holds a value that cannot be pickled" in str(info.value) and "HINT:" in str(
            info.value
        )
        assert not list((tmp_path / "ckpt").glob("step-*")), "no checkpoint folder is left"
    assert save_state(
        tmp_path / "ckpt", 3, {"model": model.state_dict(), "extra": {"epoch": 1}}
    ).is_dir()
