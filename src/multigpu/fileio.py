"""Small file operations done safely, in one place: atomic writes, appends and reads that never follow a
symbolic link planted in an output folder, and never block on a FIFO.

Why: output folders travel (copied from a cluster, shared, received with their checkpoints). A
``status.json.tmp`` or ``.locks/run.lock`` that is a symlink to a file elsewhere would make an innocent
write truncate that file; a ``manifest.json`` that is a FIFO would hang a reader. Every writer here
creates its temporary file exclusively with ``O_NOFOLLOW`` and renames it over the target (a rename
replaces a link, it does not write through it); readers open with ``O_NOFOLLOW | O_NONBLOCK`` and
accept regular files only. Standard library only.
"""

from __future__ import annotations

import os
import re
import stat
import uuid
from pathlib import Path
from typing import IO, Union

PathLike = Union[str, os.PathLike]
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafePath(OSError):
    """A path that is a symbolic link, a FIFO or a device where a regular file was expected."""


def atomic_write_text(path: PathLike, text: str, fsync: bool = False) -> None:
    """Replace ``path`` with ``text`` in one step: readers see the old or the new file, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            if fsync:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_append(path: PathLike) -> IO[str]:
    """A text file opened for appending, created if missing - refused if it is a symbolic link."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o644)
    except OSError as exc:
        if Path(path).is_symlink():
            raise UnsafePath(exc.errno, "refusing to write through a symbolic link", str(path)) from None
        raise
    return os.fdopen(fd, "a", encoding="utf-8", errors="replace")


def read_regular(path: PathLike, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of a regular file (so callers can tell "too large"); a symlink, FIFO or
    device is refused without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError as exc:
        if Path(path).is_symlink():
            raise UnsafePath(exc.errno or 40, "is a symbolic link, not a file", str(path)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO, device or socket"
            raise UnsafePath(21 if stat.S_ISDIR(mode) else 22, f"is {kind}, not a regular file", str(path))
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def ensure_real_folder(path: PathLike, what: str = "folder") -> Path:
    """``path`` as a folder that is not a symbolic link (created if missing)."""
    path = Path(path)
    if path.is_symlink():
        raise UnsafePath(40, f"the {what} is a symbolic link; refusing to write through it", str(path))
    path.mkdir(parents=True, exist_ok=True)
    return path


def tail_lines(path: PathLike, lines: int, max_bytes: int = 1 << 20) -> tuple[list[str], int]:
    """The last ``lines`` lines of a (log) file read from its end, whatever its size, and how many lines
    the part read holds. ([], 0) if it cannot be read."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - max_bytes))
            text = handle.read().decode(errors="replace")
    except OSError:
        return [], 0
    all_lines = text.split("\n")
    if all_lines and all_lines[-1] == "":
        all_lines.pop()
    return all_lines[-lines:] if lines else [], len(all_lines)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def as_shown(line: str) -> str:
    """A log line as a terminal showed it: a progress bar's redraws (\\r) keep their last state, ANSI
    colour codes are dropped."""
    line = _ANSI.sub("", line).rstrip("\r")
    return line.rsplit("\r", 1)[-1]
