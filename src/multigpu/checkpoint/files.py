"""Checkpoint folders that are complete or absent, verified before they are trusted.

Why: a checkpoint cut short by a crash, a preemption or a full disk must never be loaded, and a
corrupt one must be noticed and skipped rather than crash the resume (or worse, load garbage). Each
checkpoint is a folder ``step-<N>/`` written under a temporary name, every file fsynced, with a
``manifest.json`` (size and checksum of every file) written last; then the folder is renamed into
place in one atomic step. Loading walks from the newest folder back to the first one whose manifest
matches its files and whose contents pass the checks of :mod:`multigpu.checkpoint.untrusted`.

Every path goes through the file door (:class:`multigpu.fileio.Folder`): the folder you name and the
folders we own above it (``checkpoints``, ``best``) are real folders, never links; nothing below them is
reached through a link; reads are capped. Reading (``list``, ``verify``, ``latest``, loading) changes
nothing; only the write paths (saving, pruning, :func:`recover` on resume) rename or delete.

Why xxHash (XXH3-64, the ``xxhash`` package) and not CRC-32: the checksum guards against torn writes
and bit rot, not against an attacker (the content checks and ``weights_only=True`` do that). zlib's
CRC-32 runs at ~0.9 GB/s here, XXH3 at ~6 GB/s, and it is computed while ``torch.save`` writes, on a
second thread during the write system call - so the save costs what ``torch.save`` + ``fsync`` costs
(benchmarks/checkpoint_save.py). Manifests with ``crc32`` entries (older checkpoints) still verify.
"""

from __future__ import annotations

import json
import os
import pickle
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import torch

# explicit re-exports: the names this module has always offered
from multigpu.checkpoint.place import (
    CHECKSUM as CHECKSUM,
    MANIFEST as MANIFEST,
    OLD as OLD,
    STATE_FILE as STATE_FILE,
    CheckpointInfo as CheckpointInfo,
    HashingWriter as HashingWriter,
    Place as Place,
    digest_of as digest_of,
    file_digest as file_digest,
    manifest_entry as manifest_entry,
    split as split,
    step_name as step_name,
)
from multigpu.checkpoint.reading import (  # explicit re-exports
    MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES,
    REQUIRED as REQUIRED,
    check_contents as check_contents,
    check_manifest as check_manifest,
    is_checkpoint as is_checkpoint,
    latest as latest,
    list_checkpoints as list_checkpoints,
    load_state as load_state,
    read_manifest as read_manifest,
    safe_member_name as safe_member_name,
    verify as verify,
)
from multigpu.errors import CheckpointError, visible
from multigpu.fileio import Folder, PathLike

FORMAT = 1


# ---------------------------------------------------------------------------------------- writing


class Draft:
    """A checkpoint being written: a fresh real folder ``.tmp-step-N-*`` beside the finished ones.

    Files go in through :meth:`save` (hashed while written, fsynced); third-party writers (DCP) get
    :attr:`path` and :meth:`record` their checksums, or leave them to :func:`finalize`.
    """

    def __init__(self, place: Place, name: str) -> None:
        self.place, self.name = place, name
        self.entries: dict[str, dict[str, Any]] = {}

    @classmethod
    def sharded(cls, directory: PathLike, step: int) -> "Draft":
        """The draft every rank of a sharded save writes into (its name needs no talking)."""
        return cls(Place.of(directory), f".tmp-{step_name(step)}-sharded")

    @property
    def rel(self) -> str:
        return self.place.sub(self.name)

    @property
    def path(self) -> Path:
        return self.place.path / self.name

    def save(self, name: str, obj: Any) -> None:
        """``torch.save(obj)`` into ``name``, through the door, hashed while written, fsynced."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="multigpu-hash") as pool:
            with self.place.root.open_new(f"{self.rel}/{name}", fsync=True) as handle:
                writer = HashingWriter(handle, pool)
                try:
                    torch_save(obj, writer)
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    key = unpicklable_key(obj)
                    if key is None:  # not a value that cannot be pickled: a bug to see in full
                        raise
                    raise CheckpointError(
                        f"the checkpoint's state cannot be saved: {visible(key)} holds a value "
                        f"that cannot be pickled ({visible(' '.join(str(exc).split())[:120])}).",
                        f"keep only data in the state to save (tensors, numbers, text, lists, "
                        f"dicts): leave {visible(key)} out, or store what it describes instead "
                        "(e.g. a name, not a lambda).",
                    ) from None
        self.entries[name] = manifest_entry(
            writer.hasher.size, writer.hasher.kind, writer.hasher.digest()
        )

    def record(self, name: str, size: int, kind: str, digest: str) -> None:
        self.entries[name] = manifest_entry(size, kind, digest)

    def discard(self) -> None:
        self.place.root.remove_tree(self.rel)


def unpicklable_key(
    obj: Any, where: str = "", depth: int = 0, seen: Optional[set[Any]] = None
) -> Optional[str]:
    """The key path (``extra.schedule_fn``) of the first value in ``obj`` that pickle refuses, or None.
    Walked only after a save failed: tensors are skipped, every other leaf is pickled on its own."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 50:
        return None
    seen.add(id(obj))
    if isinstance(obj, dict):
        items: Any = ((f"{where}.{k}" if where else str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, torch.Tensor):
        return None
    else:
        try:
            pickle.dumps(obj)
        except Exception:  # noqa: BLE001 - any refusal names this key
            return where or "the state"
        return None
    for key, value in items:
        found = unpicklable_key(value, key, depth + 1, seen)
        if found is not None:
            return found
    return None


def torch_save(obj: Any, writer: Any) -> None:
    """``torch.save(obj, writer)`` without torch's own CRC-32 of each zip record: the manifest's checksum
    already covers every byte, and that second checksum (zlib's, ~0.9 GB/s) was a third of the save.
    ``torch.load`` reads such files as it reads any (``torch.serialization.set_crc32_options(False)``
    writes the same format); zip tools that check record CRCs would complain. Through torch's own
    ``_save`` with a writer made for this call - no process-wide setting is touched, so another
    thread's ``torch.save`` keeps its CRCs; if that private function ever changes, plain ``torch.save``."""
    try:
        from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _save

        zip_file = torch._C.PyTorchFileWriter(writer, False, _get_storage_alignment())
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another torch
        torch.save(obj, writer)
        return
    try:
        _save(obj, zip_file, pickle, DEFAULT_PROTOCOL, False)
    # as torch.save does: ended while the file is open (its destructor would write to a closed one)
    finally:
        zip_file.write_end_of_file()
    writer.flush()


def start_draft(directory: PathLike, step: int, unique: bool = True) -> Draft:
    """A fresh folder to write step ``step`` into. Sharded saves (every rank writes into it) pass
    ``unique=False`` so all ranks agree on the name without talking; a leftover of that name (an
    interrupted save) is removed first - by descriptors, a planted link as a link."""
    place = Place.of(directory)
    place.require(create=True)
    draft = (
        Draft(place, f".tmp-{step_name(step)}-{uuid.uuid4().hex[:8]}")
        if unique
        else Draft.sharded(directory, step)
    )
    if not unique:
        place.root.remove_tree(draft.rel)
    place.root.child(draft.rel)
    return draft


def temporary_folder(directory: PathLike, step: int, unique: bool = True) -> Path:
    """The path of a fresh :func:`start_draft` folder (for writers that take a path)."""
    return start_draft(directory, step, unique).path


def _files_of(root: Folder, rel: str, prefix: str = "") -> list[str]:
    found = []
    for name, kind in root.entries(rel):
        if kind == "folder":
            found += _files_of(root, f"{rel}/{name}", f"{prefix}{name}/")
        elif kind == "file":
            found.append(prefix + name)
        else:
            raise CheckpointError(
                f"{visible(str(root.path / rel / name))} is a {kind}, not a file of a checkpoint.",
                "a checkpoint holds plain files only.",
            )
    return found


def finalize(
    draft: Draft, step: int, meta: Optional[dict[str, Any]] = None, overwrite: bool = True
) -> Path:
    """Checksum (and fsync) what is not yet, write the manifest last, rename into place.

    Replacing an existing step takes two renames (old aside to ``.old-step-N-*``, new into place); a
    crash between them leaves the only copy aside, and :func:`recover` puts it back before anyone
    prunes or chooses a checkpoint (readers meanwhile take the aside copy as that step).
    """
    root, place = draft.place.root, draft.place
    entries = dict(draft.entries)
    kind = CHECKSUM
    for name in sorted(_files_of(root, draft.rel)):
        if name not in entries and name != MANIFEST:
            size, digest = digest_of(root, f"{draft.rel}/{name}", kind)
            _fsync_file(root, f"{draft.rel}/{name}")
            entries[name] = manifest_entry(size, kind, digest)
    manifest = {
        "format": FORMAT,
        "step": step,
        "created": time.time(),
        **(meta or {}),
        "files": dict(sorted(entries.items())),
    }
    root.write_atomic(
        f"{draft.rel}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True), fsync=True
    )
    root.fsync(draft.rel)
    final = place.sub(step_name(step))
    exists = root.kind(final) is not None
    if exists and not overwrite:
        raise CheckpointError(
            f"{visible(str(root.path / final))} already exists.",
            "choose another output folder; it is never replaced.",
        )
    if exists:  # the same step saved again (a resumed run): replace it, never half of it
        old = place.sub(f".old-{step_name(step)}-{uuid.uuid4().hex[:8]}")
        root.move(final, old)
        root.move(draft.rel, final)
        root.remove_tree(old)
    else:
        root.move(draft.rel, final)
    root.fsync(place.rel)
    return root.path / final


def _fsync_file(root: Folder, rel: str) -> None:
    with root.open_read(rel) as handle:
        os.fsync(handle.fileno())


def finalize_folder(
    tmp: PathLike,
    step: int,
    digests: Optional[dict[str, tuple[int, str]]] = None,
    meta: Optional[dict[str, Any]] = None,
    overwrite: bool = True,
) -> Path:
    """:func:`finalize` for a temporary folder given by path (``digests``: name -> (size, crc32))."""
    tmp = Path(tmp)
    draft = Draft(Place.of(tmp.parent), tmp.name)
    for name, (size, crc) in (digests or {}).items():
        draft.record(name, size, "crc32", crc)
    return finalize(draft, step, meta, overwrite)


def write_checkpoint_folder(
    directory: PathLike,
    step: int,
    fill: Callable[[Draft], Any],
    meta: Optional[dict[str, Any]] = None,
    overwrite: bool = True,
) -> Path:
    """Create ``directory/step-<N>`` atomically: ``fill(draft)`` writes the files (``draft.save``).
    ``overwrite=False``: an existing ``step-<N>`` is an error, checked before anything is written."""
    place = Place.of(directory)
    if (
        not overwrite
        and place.require(create=False)
        and place.root.kind(place.sub(step_name(step))) is not None
    ):
        raise CheckpointError(
            f"{visible(str(place.path / step_name(step)))} already exists.",
            "choose another output folder; an existing checkpoint is never replaced.",
        )
    draft = start_draft(directory, step, unique=True)
    try:
        fill(draft)
        return finalize(draft, step, meta, overwrite=overwrite)
    except BaseException:
        draft.discard()
        raise


def save_state(
    directory: PathLike, step: int, state: dict[str, Any], meta: Optional[dict[str, Any]] = None
) -> Path:
    """Save one ``state.pt`` (for replicated strategies: called on one rank only)."""
    return write_checkpoint_folder(
        directory, step, lambda draft: draft.save(STATE_FILE, state), meta
    )


def recover(directory: PathLike) -> list[Path]:
    """Finish replacements a crash interrupted (write/resume paths only): ``.old-step-N-*`` is put back as
    ``step-N`` when no ``step-N`` exists (it is then the only copy), and removed when the new one is there."""
    place = Place.of(directory)
    restored: list[Path] = []
    if not place.require(create=False):
        return restored
    for entry, kind in place.root.entries(place.rel):
        match = OLD.match(entry)
        if not match or kind != "folder":
            continue
        final = place.sub(match.group(1))
        if place.root.kind(final) is not None:
            place.root.remove_tree(place.sub(entry))
        else:
            place.root.move(place.sub(entry), final)
            restored.append(place.root.path / final)
    return restored


def prune(
    directory: PathLike, keep_last: Optional[int], newest: Optional[int] = None
) -> list[Path]:
    """Delete leftovers of interrupted writes and all but the newest ``keep_last`` checkpoints.

    ``newest``: the step just saved. Checkpoints of later steps belong to a run that was abandoned
    (the resume skipped them as corrupt): they are renamed ``abandoned-step-N`` - out of the way,
    never deleted - so retention cannot remove the checkpoint that was just written.
    """
    place = Place.of(directory)
    removed: list[Path] = []
    if not place.require(create=False):
        return removed
    recover(directory)
    for entry, _kind in place.root.entries(place.rel):
        if entry.startswith(".tmp-step-"):
            place.root.remove_tree(place.sub(entry))
            removed.append(place.path / entry)
    found = list_checkpoints(directory)
    if newest is not None:
        for info in [i for i in found if i.step > newest]:
            target = f"abandoned-{info.path.name}-{uuid.uuid4().hex[:6]}"
            place.root.move(place.sub(info.path.name), place.sub(target))
            removed.append(place.path / target)
        found = [i for i in found if i.step <= newest]
    if keep_last is not None and keep_last > 0:
        for info in found[keep_last:]:
            place.root.remove_tree(place.sub(info.path.name))
            removed.append(info.path)
    return removed
