"""Where checkpoints live and how their bytes are summed: the shared ground of writing and reading.

A :class:`Place` is a folder of ``step-N`` checkpoints reached through the file door
(:class:`multigpu.fileio.Folder`) without following links; :class:`Hasher` is the manifest's checksum
(XXH3-64 from the ``xxhash`` package, or CRC-32 where it is missing; see :mod:`multigpu.checkpoint.files`).
"""

from __future__ import annotations

import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Optional

from multigpu.errors import CheckpointError, visible
from multigpu.fileio import Folder, PathLike

xxhash: Optional[ModuleType]
# a declared dependency; without it new checkpoints fall back to CRC-32 (slower, same promises)
try:
    import xxhash
except ImportError:  # pragma: no cover
    xxhash = None

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
NAME = re.compile(r"^step-([0-9]{8,})$")
OLD = re.compile(r"^\.old-(step-[0-9]{8,})-[0-9a-f]+$")
#: Folders we own: when a checkpoint directory sits in one of these, that one must be a real folder too.
OWN_FOLDERS = ("checkpoints", "best")
#: The checksum new manifests carry.
CHECKSUM = "xxh3" if xxhash is not None else "crc32"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    meta: dict[str, Any]


# ---------------------------------------------------------------------------------------- places


@dataclass(frozen=True)
class Place:
    """A folder of ``step-N`` checkpoints, reached from ``root`` one real folder at a time.

    The root is the folder above the one you named, and above the folders we own (``out`` for
    ``out/checkpoints/best``): the named folder and ``checkpoints``/``best`` above it must be real
    folders, so a planted ``out/checkpoints -> elsewhere`` link is refused, never written through.
    """

    root: Folder
    rel: str

    @classmethod
    def of(cls, directory: PathLike) -> "Place":
        path = Path(directory)
        if path.name in ("", ".", ".."):
            return cls(Folder(path), "")
        parts = [path.name]
        parent = path.parent
        while parent.name in OWN_FOLDERS and parent != parent.parent:
            parts.insert(0, parent.name)
            parent = parent.parent
        return cls(Folder(parent), "/".join(parts))

    @property
    def path(self) -> Path:
        return self.root.path / self.rel if self.rel else self.root.path

    def sub(self, *names: str) -> str:
        return "/".join(p for p in (self.rel, *names) if p)

    def state(self) -> Optional[str]:
        """None when missing; "folder" when usable; otherwise what is in the way ("link", "file"...)."""
        parts = self.rel.split("/") if self.rel else []
        for depth in range(1, len(parts) + 1):
            try:
                kind = self.root.kind("/".join(parts[:depth]))
            except OSError:
                return "link"
            if kind != "folder":
                return kind
        return "folder"

    def require(self, create: bool) -> bool:
        """True if the folder exists (created when ``create``); a link or file in the way: CheckpointError."""
        state = self.state()
        if state not in (None, "folder"):
            what = (
                "is a symbolic link (or has one on its way)"
                if state == "link"
                else "is neither a folder nor a file"
                if state == "other"
                else f"is a {state}"
            )
            raise CheckpointError(
                f"{visible(str(self.path))} {what}, not a real folder: refusing to read, write or "
                "prune checkpoints through it.",
                "remove the link and let multigpu create the folder, or choose another out_dir.",
            )
        if state is None and create:
            try:
                self.root.create().child(self.rel)
            except OSError as exc:
                raise CheckpointError(
                    f"cannot create {visible(str(self.path))}: {exc.strerror or exc}.",
                    "choose a folder you can write to.",
                ) from None
            return True
        return state == "folder"


def split(path: PathLike) -> tuple[Folder, str]:
    """A step folder (or a file) named by the caller: its parent is the root, the name is refused if a link."""
    path = Path(path)
    return Folder(path.parent), path.name


def step_name(step: int) -> str:
    return f"step-{step:08d}"


# ---------------------------------------------------------------------------------------- checksums


class Hasher:
    """Size and checksum of bytes as they go by ("xxh3" when xxhash is installed, else "crc32")."""

    def __init__(self) -> None:
        self.kind = "xxh3" if xxhash is not None else "crc32"
        self._xxh = xxhash.xxh3_64() if xxhash is not None else None
        self._crc = 0
        self.size = 0

    def update(self, data: Any) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def digest(self) -> str:
        return self._xxh.hexdigest() if self._xxh is not None else f"{self._crc:08x}"


class HashingWriter:
    """The file object ``torch.save`` writes into: each large block is hashed on a second thread while
    the write system call copies it (both release the GIL), so the checksum costs no extra pass."""

    def __init__(self, handle: IO[bytes], pool: Optional[ThreadPoolExecutor]) -> None:
        self.handle, self.pool, self.hasher = handle, pool, Hasher()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.pool is not None and view.nbytes >= 1 << 20:
            pending = self.pool.submit(self.hasher.update, view)
            self.handle.write(view)
            pending.result()
        else:
            self.hasher.update(view)
            self.handle.write(view)
        self.hasher.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.handle.flush()


def manifest_entry(size: int, kind: str, digest: str) -> dict[str, Any]:
    return {"size": size, kind: digest}


def file_digest(path: PathLike) -> tuple[int, str]:
    """Size and CRC-32 (hex) of a file: the legacy ``crc32`` manifest entry (tests forge manifests with it)."""
    folder, name = split(path)
    crc, size = 0, 0
    with folder.open_read(name) as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, f"{crc:08x}"


def digest_of(folder: Folder, rel: str, kind: str) -> tuple[int, str]:
    hasher = Hasher() if kind == "xxh3" else None
    crc, size = 0, 0
    with folder.open_read(rel) as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            if hasher is not None:
                hasher.update(block)
            else:
                crc = zlib.crc32(block, crc)
            size += len(block)
    return size, (hasher.digest() if hasher is not None else f"{crc:08x}")
