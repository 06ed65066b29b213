"""The file door (multigpu.fileio.Folder): links, FIFOs, devices and names that leave the folder."""

from __future__ import annotations

import os
import threading

import pytest

from multigpu.fileio import Folder, UnsafePath


@pytest.fixture
def tree(tmp_path):
    """``out/`` (the root), a victim folder outside it with one file, and a FIFO."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    return out, victim


def test_links_below_the_root_are_refused_at_every_component(tree):
    out, victim = tree
    (out / "checkpoints").symlink_to(victim)
    root = Folder(out)
    for call in (
        lambda: root.child("checkpoints"),
        lambda: root.child("checkpoints/step-1"),
        lambda: root.write_atomic("checkpoints/x.txt", "x"),
        lambda: root.load_text("checkpoints/precious.txt"),
        lambda: root.open_append("checkpoints/log.txt"),
        lambda: root.entries("checkpoints"),
        lambda: root.remove_tree("checkpoints/precious.txt"),
    ):
        with pytest.raises(UnsafePath):
            call()
    assert (
        sorted(os.listdir(victim)) == ["precious.txt"]
        and (victim / "precious.txt").read_text() == "keep me"
    )


def test_a_link_as_the_last_component_is_never_written_through(tree):
    out, victim = tree
    (out / "curves.png").symlink_to(victim / "precious.txt")
    (out / "log.txt").symlink_to(victim / "precious.txt")
    root = Folder(out)
    root.write_atomic("curves.png", b"png")  # replaces the link itself
    assert not (out / "curves.png").is_symlink() and (out / "curves.png").read_bytes() == b"png"
    with pytest.raises(UnsafePath):
        root.open_append("log.txt")
    with pytest.raises(UnsafePath):
        root.load_bytes("log.txt")
    assert (victim / "precious.txt").read_text() == "keep me"


def test_fifos_and_devices_are_refused_without_blocking(tree):
    out, _ = tree
    os.mkfifo(out / "status.json")
    (out / "metrics.csv").symlink_to("/dev/zero")
    root = Folder(out)
    done = []

    def attempt():
        for name in ("status.json", "metrics.csv"):
            with pytest.raises(UnsafePath):
                root.load_text(name)
        with pytest.raises(UnsafePath):
            root.open_append("status.json")
        assert root.tail_lines("status.json", 5) == ([], 0)
        done.append(True)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert done == [True], "a read blocked on a FIFO"


def test_reads_are_capped_and_names_stay_inside(tree):
    out, _ = tree
    root = Folder(out)
    root.write_atomic("big.txt", "x" * 1000)
    assert len(root.load_bytes("big.txt", limit=10)) == 11
    with pytest.raises(UnsafePath, match="larger than 10 bytes"):
        root.load_text("big.txt", limit=10)
    for name in ("../victim/precious.txt", "/etc/passwd", "a/../../x"):
        with pytest.raises(UnsafePath):
            root.load_text(name)


def test_remove_tree_deletes_links_not_their_targets(tree):
    out, victim = tree
    step = Folder(out).child("checkpoints/step-1")
    (step.path / "state.pt").write_bytes(b"x")
    (step.path / "evil").symlink_to(victim)
    Folder(out).remove_tree("checkpoints/step-1")
    assert not (out / "checkpoints" / "step-1").exists()
    assert (victim / "precious.txt").read_text() == "keep me"


def test_rename_never_replaces_and_a_failed_write_leaves_the_old_file(tree):
    out, _ = tree
    root = Folder(out)
    root.write_atomic("a.txt", "a")
    root.write_atomic("b.txt", "b")
    with pytest.raises(UnsafePath, match="already exists"):
        root.move("a.txt", "b.txt")
    with pytest.raises(RuntimeError):
        with root.open_new("b.txt") as handle:
            handle.write(b"half")
            raise RuntimeError("crash while writing")
    assert root.load_text("b.txt") == "b"
    # no temporary file left behind
    assert [name for name, _ in root.entries()] == ["a.txt", "b.txt"]


def test_child_refuses_a_file_in_place_of_a_folder(tree):
    out, _ = tree
    (out / "logs").write_text("not a folder")
    with pytest.raises(UnsafePath):
        Folder(out).child("logs")
    assert Folder(out).kind("logs") == "file" and Folder(out).kind("nothing") is None
