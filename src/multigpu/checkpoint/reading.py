"""Reading checkpoint folders: manifests, verification, the newest good one, safe loading. Reads only.

Why apart from writing: ``multigpu checkpoint list|verify|consolidate`` and a resume's choice must never
change what they read (a received folder is evidence, and a read-only mount must work); every function
here opens files through the door (:mod:`multigpu.fileio`) for reading and nothing else. What will be
unpickled is checked with limits first (:mod:`multigpu.checkpoint.untrusted`): a checkpoint that fails a
check is skipped by :func:`latest` like a torn one.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Optional, Union

import torch

from multigpu.checkpoint.place import (
    MANIFEST,
    NAME,
    OLD,
    STATE_FILE,
    CheckpointInfo,
    Place,
    digest_of,
    split,
)
from multigpu.checkpoint.untrusted import check_zip, load_checked
from multigpu.errors import CheckpointError, visible
from multigpu.fileio import PathLike

# ---------------------------------------------------------------------------------------- reading

#: A manifest lists a few files; anything bigger is not one of ours.
MAX_MANIFEST_BYTES = 16 << 20
_DIGESTS = {"xxh3": re.compile(r"[0-9a-f]{16}"), "crc32": re.compile(r"[0-9a-f]{8}")}
#: The files a checkpoint of each kind cannot be loaded without.
REQUIRED = {False: (STATE_FILE,), True: (".metadata", "extra.pt")}


def read_manifest(path: PathLike) -> dict[str, Any]:
    """The manifest of checkpoint folder ``path``, its structure checked (a CheckpointError otherwise)."""
    folder, name = split(path)
    shown = visible(str(Path(path) / MANIFEST))
    try:
        with folder.open_read(f"{name}/{MANIFEST}") as handle:
            raw = handle.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(
            f"{visible(str(path))} has no {MANIFEST}: it was not written completely.",
            "delete the folder; an earlier checkpoint is used instead.",
        ) from None
    except OSError as exc:
        raise CheckpointError(
            f"{shown} is unreadable ({exc.strerror or exc}).", "delete the folder."
        ) from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"{shown} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a multigpu manifest.",
            "delete the folder.",
        )
    try:
        manifest: dict[str, Any] = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"{shown} is not valid JSON ({visible(' '.join(str(exc).split())[:100])}).",
            "delete the folder.",
        ) from None
    check_manifest(manifest, Path(path) / MANIFEST)
    return manifest


def check_manifest(manifest: Any, where: PathLike) -> None:
    """Every entry a plain relative name inside the folder with an integer size and one checksum; the
    state files of its kind present. A manifest is data from disk: nothing in it is trusted further."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(
            f"{visible(str(where))} is not a valid multigpu manifest: {why}.", "delete the folder."
        )

    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise bad("it has no 'files' mapping")
    for key in ("step", "world_size", "epoch"):
        if key in manifest and (
            isinstance(manifest[key], bool) or not isinstance(manifest[key], int)
        ):
            raise bad(f"{key!r} is not an integer")
    # optimizer_flat: how the optimizer's shards are laid out
    for key in ("sharded", "optimizer_flat"):
        if not isinstance(manifest.get(key, False), bool):
            raise bad(f"{key!r} is not true or false")
    if len(manifest["files"]) > 1_000_000:
        raise bad("it lists more than a million files")
    for name, entry in manifest["files"].items():
        safe_member_name(name, where)
        if (
            not isinstance(entry, dict)
            or isinstance(entry.get("size"), bool)
            or not isinstance(entry.get("size"), int)
            or entry["size"] < 0
            or _checksum(entry) is None
        ):
            raise bad(
                f"the entry of '{visible(name)}' needs an integer 'size' and one checksum: a "
                "16-digit hex 'xxh3' or an 8-digit hex 'crc32'"
            )
    missing = [
        name for name in REQUIRED[manifest.get("sharded", False)] if name not in manifest["files"]
    ]
    if missing:
        raise bad(f"it does not list {missing[0]}, without which the checkpoint cannot load")
    if manifest.get("sharded") and not any(n.endswith(".distcp") for n in manifest["files"]):
        raise bad("a sharded checkpoint lists no .distcp shard")


def _checksum(entry: dict[str, Any]) -> Optional[tuple[str, str]]:
    """(kind, digest) of a manifest entry: exactly one known checksum, well formed."""
    found = [(kind, entry[kind]) for kind in _DIGESTS if kind in entry]
    if (
        len(found) != 1
        or not isinstance(found[0][1], str)
        or not _DIGESTS[found[0][0]].fullmatch(found[0][1])
    ):
        return None
    return found[0]


def safe_member_name(name: Any, where: PathLike) -> str:
    """A file name inside a checkpoint folder: relative, no ``..``, no control characters."""
    pure = PurePosixPath(name) if isinstance(name, str) else None
    if pure is not None:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            pure = None
    if (
        pure is None
        or not name
        or len(name) > 1024
        or pure.is_absolute()
        or "\\" in name
        or any(part in ("", ".", "..") for part in name.split("/"))
        or re.search(r"[\x00-\x1f\x7f-\x9f]", name)
    ):
        raise CheckpointError(
            f"{visible(str(where))} names the file '{visible(str(name)[:80])}', which is not inside the "
            "checkpoint folder (or not a plain name).",
            "the manifest is corrupt or was tampered with; delete the folder.",
        )
    checked: str = name
    return checked


def verify(path: PathLike, checksums: bool = True, contents: bool = True) -> dict[str, Any]:
    """Raise :class:`CheckpointError` unless every file listed in the manifest is there, whole and
    unchanged, and (``contents``) the files that will be unpickled pass the checks of
    :mod:`multigpu.checkpoint.untrusted`. Reads only."""
    path = Path(path)
    folder, name = split(path)
    shown = visible(str(path))
    try:
        kind = folder.kind(name)
    except OSError:
        kind = "link"
    if kind == "link":
        raise CheckpointError(
            f"checkpoint {shown} is a symbolic link.",
            "a checkpoint is a folder of its own; copy it.",
        )
    if kind != "folder":
        raise CheckpointError(
            f"no checkpoint folder at {shown}.",
            "`multigpu checkpoint list DIR` shows the checkpoints in DIR.",
        )
    manifest = read_manifest(path)
    for member, expected in manifest["files"].items():
        rel = f"{name}/{member}"
        try:
            found = folder.kind(rel)
        except OSError:
            found = "link"
        if found == "link":
            raise CheckpointError(
                f"checkpoint {shown}: {visible(member)} is a symbolic link (or reached through one).",
                "a checkpoint holds plain files only; delete it.",
            )
        if found != "file":
            raise CheckpointError(
                f"checkpoint {shown} lacks {visible(member)}.", "it is incomplete; delete it."
            )
        size = folder.size(rel)
        if size != expected["size"]:
            raise CheckpointError(
                f"checkpoint {shown}: {visible(member)} has {size} bytes, the manifest says {expected['size']} "
                "(truncated?).",
                "it is corrupt; delete it.",
            )
        if checksums:
            checksum = _checksum(expected)
            if checksum is None:  # read_manifest refuses such an entry
                raise CheckpointError(
                    f"checkpoint {shown}: {visible(member)} has no valid checksum.",
                    "it is corrupt; delete it.",
                )
            kind_, digest = checksum
            if digest_of(folder, rel, kind_)[1] != digest:
                raise CheckpointError(
                    f"checkpoint {shown}: {visible(member)} does not match its checksum "
                    f"({'CRC-32' if kind_ == 'crc32' else 'XXH3'}).",
                    "it is corrupt; delete it.",
                )
    if contents:
        check_contents(path, manifest)
    return manifest


def check_contents(path: Path, manifest: dict[str, Any]) -> None:
    """What loading will unpickle, checked with limits first (a CheckpointError: skip this checkpoint)."""
    folder, name = split(path)
    if manifest.get("sharded"):
        # DCP: imported for sharded folders only
        from multigpu.checkpoint.dcp_safe import read_checked_metadata

        read_checked_metadata(path, manifest)
    for member in (STATE_FILE, "extra.pt"):
        if member in manifest["files"]:
            with folder.open_read(f"{name}/{member}") as handle:
                check_zip(handle, visible(str(path / member)))


def is_checkpoint(path: PathLike) -> bool:
    """True when ``path`` is a folder with a manifest (one checkpoint), False for a folder of them."""
    folder, name = split(path)
    try:
        return folder.kind(f"{name}/{MANIFEST}") == "file"
    except OSError:
        return False


def list_checkpoints(directory: PathLike) -> list[CheckpointInfo]:
    """Completed checkpoint folders (renamed into place), newest first; not yet verified. A step whose
    replacement a crash interrupted is listed as its ``.old-step-N-*`` copy (read-only: nothing is moved)."""
    place = Place.of(directory)
    if not place.require(create=False):
        return []
    steps: dict[int, Path] = {}
    aside: dict[int, Path] = {}
    for entry, kind in place.root.entries(place.rel):
        if kind != "folder":  # a linked step would be read from elsewhere
            continue
        match, old = NAME.match(entry), OLD.match(entry)
        if match:
            steps[int(match.group(1))] = place.path / entry
        elif old:
            aside.setdefault(int(old.group(1)[len("step-") :]), place.path / entry)
    for step, path in aside.items():
        steps.setdefault(step, path)
    return [CheckpointInfo(steps[s], s, {}) for s in sorted(steps, reverse=True)]


def latest(
    directory: PathLike,
    checksums: bool = True,
    report: Callable[[str], None] = lambda msg: warnings.warn(msg, stacklevel=3),
) -> Optional[CheckpointInfo]:
    """The newest checkpoint that verifies; each one skipped is reported with the reason. Reads only."""
    for info in list_checkpoints(directory):
        try:
            manifest = verify(info.path, checksums)
        except CheckpointError as exc:
            report(
                f"multigpu: skipping checkpoint {visible(info.path.name)}: {visible(' '.join(exc.message.split()))}"
            )
            continue
        return CheckpointInfo(info.path, info.step, manifest)
    return None


def load_state(
    path: PathLike, map_location: Union[str, torch.device, None] = "cpu"
) -> dict[str, Any]:
    """Load ``state.pt`` of a checkpoint folder (or a plain file) safely: the zip and its pickle checked
    with limits first, then tensors and plain types only (``weights_only=True``)."""
    path = Path(path)
    folder, name = split(path)
    try:
        kind = folder.kind(name)
    except OSError:
        kind = "link"
    rel = f"{name}/{STATE_FILE}" if kind == "folder" else name
    shown = visible(str(path / STATE_FILE if kind == "folder" else path))
    try:
        with folder.open_read(rel) as handle:
            state: dict[str, Any] = load_checked(handle, shown, map_location)
            return state
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(
            f"no checkpoint at {shown}.",
            "check the path; `multigpu checkpoint list DIR` shows them.",
        ) from None
    except Exception as exc:
        raise CheckpointError(
            f"cannot load {shown}: {visible(' '.join(str(exc).split())[:300])}",
            "the file is corrupt or not a torch checkpoint; use an earlier one.",
        ) from None
