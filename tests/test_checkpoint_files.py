"""Atomic checkpoint folders: manifest, verification, the latest good one, retention, safe loading."""

import json
import os

import pytest
import torch
from torch import nn

from multigpu import checkpoint
from multigpu.checkpoint.files import MANIFEST, STATE_FILE, step_name
from multigpu.checkpoint.place import CHECKSUM, digest_of
from multigpu.errors import CheckpointError
from multigpu.fileio import Folder
from multigpu.strategies import clean_state_dict, unwrap_module


def _state(value: float) -> dict:
    return {
        "model": {"w": torch.full((4,), value)},
        "epoch": int(value),
        "name": "x",
        "lr": [0.1, 0.2],
    }


def test_save_writes_a_folder_with_a_matching_manifest(tmp_path):
    path = checkpoint.save_state(tmp_path, 12, _state(1.0), meta={"epoch": 1})
    assert path == tmp_path / "step-00000012"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 12 and manifest["epoch"] == 1
    size, digest = digest_of(Folder(path), STATE_FILE, CHECKSUM)
    assert manifest["files"][STATE_FILE] == {"size": size, CHECKSUM: digest}
    assert CHECKSUM == "xxh3"  # xxhash is a dependency: the fast checksum is the one written
    loaded = checkpoint.load_state(path)
    assert torch.equal(loaded["model"]["w"], torch.ones(4)) and loaded["lr"] == [0.1, 0.2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_latest_is_the_newest_good_one_and_skips_corrupt_and_truncated(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save_state(tmp_path, step, _state(float(step)))
    # step 4: flipped byte (same size); step 3: truncated; step 2: manifest missing (never finished)
    data = bytearray((tmp_path / step_name(4) / STATE_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / step_name(4) / STATE_FILE).write_bytes(bytes(data))
    with open(tmp_path / step_name(3) / STATE_FILE, "r+b") as handle:
        handle.truncate(100)
    os.remove(tmp_path / step_name(2) / MANIFEST)
    reports = []
    info = checkpoint.latest(tmp_path, report=reports.append)
    assert info.step == 1
    assert torch.equal(checkpoint.load_state(info.path)["model"]["w"], torch.ones(4))
    assert len(reports) == 3
    assert "does not match its checksum" in reports[0]
    assert "manifest says" in reports[1] and "truncated" in reports[1]
    assert "no manifest.json" in reports[2]


def test_an_interrupted_write_is_never_listed_and_is_cleaned_up(tmp_path):
    checkpoint.save_state(tmp_path, 1, _state(1.0))
    partial = tmp_path / ".tmp-step-00000002-deadbeef"
    partial.mkdir()
    (partial / STATE_FILE).write_bytes(b"half a checkpoint")
    assert [i.step for i in checkpoint.list_checkpoints(tmp_path)] == [1]
    assert checkpoint.latest(tmp_path).step == 1
    checkpoint.prune(tmp_path, keep_last=5)
    assert not partial.exists()


def test_failure_inside_a_write_leaves_nothing(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        checkpoint.save_state(tmp_path, 5, {"bad": Unpicklable()})
    assert list(tmp_path.iterdir()) == []


def test_retention_keeps_the_last_k(tmp_path):
    for step in range(6):
        checkpoint.save_state(tmp_path, step, _state(float(step)))
    checkpoint.prune(tmp_path, keep_last=2)
    assert [i.step for i in checkpoint.list_checkpoints(tmp_path)] == [5, 4]


def test_saving_the_same_step_again_replaces_it_whole(tmp_path):
    checkpoint.save_state(tmp_path, 7, _state(1.0))
    checkpoint.save_state(tmp_path, 7, _state(2.0))
    assert checkpoint.load_state(checkpoint.latest(tmp_path).path)["epoch"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_name(7)]


def test_loading_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="cannot load"):
        checkpoint.load_state(tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load_state(tmp_path / "missing")


def test_clean_state_dict_loads_into_a_plain_model():
    model = nn.Sequential(nn.Linear(2, 2))
    model[0] = torch.compile(model[0]) if hasattr(torch, "compile") else model[0]
    wrapped = nn.DataParallel(model)
    state = clean_state_dict(unwrap_module(wrapped).state_dict())
    assert sorted(state) == ["0.bias", "0.weight"]
    nn.Sequential(nn.Linear(2, 2)).load_state_dict(state)
    other_tool = {f"module.{k}": v for k, v in state.items()}
    assert sorted(clean_state_dict(other_tool)) == ["0.bias", "0.weight"]


def test_retention_never_removes_the_checkpoint_just_written(tmp_path):
    """A resume skipped a corrupt step-9 and went on from step 2: saving step 3 with keep_last=1 must
    keep step 3 and move step 9 aside, not delete it."""
    for step in (1, 2, 9):
        checkpoint.save_state(tmp_path, step, _state(float(step)))
    moved = checkpoint.prune(tmp_path, keep_last=1, newest=2)
    checkpoint.save_state(tmp_path, 3, _state(3.0))
    moved += checkpoint.prune(tmp_path, keep_last=1, newest=3)
    assert [i.step for i in checkpoint.list_checkpoints(tmp_path)] == [3]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("abandoned-step-00000009")]
    assert len(aside) == 1 and (aside[0] / STATE_FILE).exists()
