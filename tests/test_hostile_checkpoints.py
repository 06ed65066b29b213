"""Received checkpoints that try to exhaust memory, crash the interpreter, or reach outside their folder.

Each forged checkpoint uses only what the allow-lists admit (DCP's own metadata classes, a torch.save
zip), so only the limits of :mod:`multigpu.checkpoint.untrusted` and the file door stand in the way. Each
case runs a real process under an address-space limit (RLIMIT_AS 3 GB) and a timeout: the promise is one
``multigpu: error: ... HINT:`` line (or the checkpoint skipped with a line saying why), no traceback, no
crash, fast - never gigabytes or minutes. Plus: the read-only commands leave their input byte for byte
unchanged, and a planted ``checkpoints`` link makes a save fail instead of writing or pruning elsewhere.
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
    return sharded.save(folder / "ckpt", 3, model, opt, {"trainer": {"epoch": 1}}, is_main=True,
                        barrier=lambda: None, meta={"world_size": 1})


def replicated_ckpt(folder: Path, name: str = "ckpt", step: int = 3) -> Path:
    from multigpu.checkpoint import files

    model, opt = _tiny()
    return files.save_state(folder / name, step, {"model": model.state_dict(), "optimizer": opt.state_dict()})


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


class LongPath:
    """Pickles as ``PosixPath(s, s, ..., s)``: 2,000 references to one 1-MiB string (about 1 MB of file)."""

    def __reduce__(self):
        import pathlib

        return (pathlib.PosixPath, tuple(["a" * (1 << 20)] * 2000))


def deep_tuple_in(pickled: bytes, marker: str, depth: int = 1_000_000) -> bytes:
    """Replace the protocol-2 string ``marker`` by a ``depth``-deep nested 1-tuple (2 bytes a level)."""
    raw = marker.encode()
    opcode = b"X" + len(raw).to_bytes(4, "little") + raw
    assert pickled.count(opcode) == 1
    return pickled.replace(opcode, b")" + b"\x85" * depth)


def metadata_long_path(work: Path) -> None:
    step = sharded_ckpt(work)
    metadata = read_metadata(step)
    info = next(iter(metadata.storage_data.values()))
    object.__setattr__(info, "relative_path", LongPath())
    write_metadata(step, pickle.dumps(metadata, protocol=2))


def metadata_repeated_chunk(work: Path) -> None:
    step = sharded_ckpt(work)
    metadata = read_metadata(step)
    entry = metadata.state_dict_metadata["model.0.weight"]
    entry.chunks = [entry.chunks[0]] * 200_000  # one object, memoised: ~1 MB of pickle
    write_metadata(step, pickle.dumps(metadata, protocol=2))


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


def bad_newest_checkpoint(work: Path, forge: Callable[[Path], None]) -> None:
    """A Trainer's out/checkpoints with a good step 1 and a step 9 whose manifest verifies but whose
    state.pt is forged."""
    from multigpu.checkpoint import files

    model = nn.Linear(2, 1)
    good = {"model": model.state_dict(), "optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(),
            "trainer": {"epoch": 0, "batch_in_epoch": 1, "global_step": 1}}
    files.save_state(work / "out" / "checkpoints", 1, good)
    step = files.save_state(work / "out" / "checkpoints", 9, {"XXDEEPKEYXX": 1})
    forge(step / "state.pt")
    refresh(step, "state.pt")


def deep_state_pt(work: Path) -> None:
    bad_newest_checkpoint(work, lambda pt: rezip(pt, lambda name, data: deep_tuple_in(data, "XXDEEPKEYXX")
                                                 if name.endswith("/data.pkl") else data))


def deflated_state_pt(work: Path, elements: int = 256 << 20) -> None:
    """A 1 GiB tensor of zeros stored as a deflated zip record: about 1 MB on disk."""
    import collections

    storage = object()

    class Rebuild:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2, (storage, 0, (elements,), (1,), False, collections.OrderedDict()))

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
                    handle.write(zeros[:min(left, len(zeros))])
                    left -= min(left, len(zeros))
            out.writestr(zipfile.ZipInfo("archive/version"), b"3")

    bad_newest_checkpoint(work, make)


def deep_extra_pt(work: Path) -> None:
    step = sharded_ckpt(work)
    buffer = io.BytesIO()
    torch.save({"XXDEEPKEYXX": 1}, buffer)
    (step / "extra.pt").write_bytes(buffer.getvalue())
    rezip(step / "extra.pt", lambda name, data: deep_tuple_in(data, "XXDEEPKEYXX") if name.endswith("/data.pkl")
          else data)
    refresh(step, "extra.pt")


TRAIN_TINY = ("import torch, multigpu as mg; from torch import nn; from torch.utils.data import TensorDataset\n"
              "class T(mg.Trainer):\n    def compute_loss(self, b): return nn.functional.mse_loss(self.model(b[0]), b[1])\n"
              "run = mg.init(); T(run, nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1), out_dir='out', "
              "progress=False, plot=False, keep_last=1, epochs=3).fit(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)))")


# ----------------------------------------------------------------------------------------- running

def _limited() -> None:
    limit = LIMIT_GB << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def cli(*argv: str) -> list:
    """``python -m multigpu ARGV`` with the test's token on its command line (found by ``no_leftovers``)."""
    return ["-c", "import sys; from multigpu.cli import main; sys.exit(main(sys.argv[2:]))", "{token}", *argv]


def run_limited(argv: list, work: Path, token: str, timeout: float = 60) -> subprocess.CompletedProcess:
    argv = [token if a == "{token}" else a for a in argv]
    if argv[0] == "-c" and "{token}" not in argv and token not in argv:
        argv = [*argv, token]  # a script run with -c: the token is its (unused) argument
    return subprocess.run([PY, *argv], cwd=work, env=child_env(), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_limited)


CASES = [
    # (id, argv, forge, outcome: "error" with this fragment, or "skipped" with this fragment in the output)
    ("metadata-long-path", cli("checkpoint", "consolidate", STEP, "--out", "out"), metadata_long_path,
     "error", "refused before loading"),
    ("metadata-repeated-chunk", cli("checkpoint", "consolidate", STEP, "--out", "out"),
     metadata_repeated_chunk, "error", "more than 65,536 chunks"),
    ("metadata-deep-tuple-key", cli("checkpoint", "consolidate", STEP, "--out", "out"),
     metadata_deep_key, "error", "nests deeper than"),
    ("metadata-overlapping-chunks", cli("checkpoint", "verify", STEP), metadata_overlapping_chunks,
     "error", "overlapping chunks"),
    ("metadata-deep-tuple-key-listed", cli("checkpoint", "list", "ckpt"), metadata_deep_key,
     "listed", "CORRUPT"),
    ("extra-pt-deep-pickle", cli("checkpoint", "verify", STEP), deep_extra_pt, "error",
     "nests deeper than"),
    ("state-pt-deep-pickle-resume", ["-c", TRAIN_TINY], deep_state_pt, "skipped",
     "skipping checkpoint step-00000009"),
    ("state-pt-deflated-record-resume", ["-c", TRAIN_TINY], deflated_state_pt, "skipped",
     "skipping checkpoint step-00000009"),
]


@pytest.mark.parametrize("case_id, argv, forge, outcome, fragment", CASES, ids=[c[0] for c in CASES])
def test_a_forged_checkpoint_is_one_line_or_skipped(tmp_path, case_id, argv, forge, outcome, fragment, no_leftovers):
    forge(tmp_path)
    proc = run_limited(argv, tmp_path, no_leftovers)  # timeout 60 s: minutes (200,000 chunks) before the limits
    output = proc.stdout + proc.stderr
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {output[-2000:]}"
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("multigpu: error:")]
    if outcome == "error":
        assert proc.returncode != 0 and len(errors) == 1, output[-3000:]
        assert "HINT:" in errors[0] and fragment in errors[0], errors[0]
        assert len(errors[0]) < 1000
    elif outcome == "listed":
        assert proc.returncode == 0 and fragment in proc.stdout, output[-3000:]
    else:  # the forged newest checkpoint is skipped like a torn one; the run resumes from step 1
        assert proc.returncode == 0 and not errors, output[-3000:]
        assert fragment in output and "resumed from" in output and "step 1)" in output, output[-3000:]


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
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else ""
            found[str(path.relative_to(root))] = (stat.st_mode, stat.st_size, stat.st_mtime_ns, digest)
    return found


@pytest.mark.parametrize("argv", [["list", "ckpt"], ["verify", STEP], ["consolidate", "ckpt", "--out", "out"]],
                         ids=["list", "verify", "consolidate"])
def test_checkpoint_commands_never_change_their_input(tmp_path, argv, no_leftovers):
    """A crash left an .old-step copy (of a step that exists, and of one that does not) and a .tmp draft:
    a resume would fix them; the commands only read."""
    sharded_ckpt(tmp_path)
    for name in (".old-step-00000003-deadbeef", ".old-step-00000002-deadbeef", ".tmp-step-00000004-cafe0000"):
        (tmp_path / "ckpt" / name).mkdir()
        (tmp_path / "ckpt" / name / "kept.txt").write_text("evidence")
    before = _fingerprint(tmp_path / "ckpt")
    proc = run_limited(cli("checkpoint", *argv), tmp_path, no_leftovers, timeout=120)  # one process: seconds
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _fingerprint(tmp_path / "ckpt") == before


# ----------------------------------------------------------------------------------------- planted links

def test_a_planted_checkpoints_link_stops_the_save_with_one_line(tmp_path, no_leftovers):
    victim = tmp_path / "victim" / "ckpts"
    (victim / "step-00000001").mkdir(parents=True)
    (victim / "step-00000001" / "precious.bin").write_text("someone else's checkpoint")
    work = tmp_path / "work"
    (work / "out").mkdir(parents=True)
    (work / "out" / "checkpoints").symlink_to(victim)
    before = _fingerprint(tmp_path / "victim")
    proc = run_limited(["-c", TRAIN_TINY], work, no_leftovers, timeout=120)  # a 1-step Trainer: seconds
    errors = [line for line in proc.stderr.splitlines() if line.startswith("multigpu: error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "link" in errors[0], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert _fingerprint(tmp_path / "victim") == before


def test_a_linked_step_folder_is_never_listed_nor_pruned(tmp_path):
    from multigpu.checkpoint import files

    elsewhere = replicated_ckpt(tmp_path, "elsewhere", step=7)
    replicated_ckpt(tmp_path, "ckpt", step=1)
    (tmp_path / "ckpt" / "step-00000007").symlink_to(elsewhere)
    assert [i.step for i in files.list_checkpoints(tmp_path / "ckpt")] == [1]
    files.save_state(tmp_path / "ckpt", 2, {"x": torch.ones(1)})
    files.prune(tmp_path / "ckpt", keep_last=1, newest=2)
    assert (elsewhere / "state.pt").exists()


def test_the_manifest_names_are_shown_without_terminal_escapes(tmp_path, no_leftovers):
    step = replicated_ckpt(tmp_path)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["x\u009b2J\u009d0;PWN"] = {"size": 1, "crc32": "00000000"}
    (step / "manifest.json").write_text(json.dumps(manifest))
    proc = run_limited(cli("checkpoint", "verify", str(step)), tmp_path, no_leftovers)
    assert proc.returncode != 0 and "\x9b" not in proc.stderr and "\\x9b" in proc.stderr, proc.stderr


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
    for bad, key in ((lambda x: x, "extra.schedule"), (threading.Lock(), "extra.schedule"),
                     ([1, {"deep": (x for x in ())}], "extra.schedule[1].deep")):
        with pytest.raises(CheckpointError) as info:
            save_state(tmp_path / "ckpt", 3, {"model": model.state_dict(), "extra": {"epoch": 1, "schedule": bad}})
        assert f"{key} holds a value that cannot be pickled" in str(info.value) and "HINT:" in str(info.value)
        assert not list((tmp_path / "ckpt").glob("step-*")), "no checkpoint folder is left"
    assert save_state(tmp_path / "ckpt", 3, {"model": model.state_dict(), "extra": {"epoch": 1}}).is_dir()
