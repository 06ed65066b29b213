"""One lock per run folder, so two queues on the same ``--out`` never run (or submit) a run twice.

Why ``fcntl.flock`` on a file: the kernel drops the lock when its holder dies - a crashed queue never
leaves a stale lock behind, and nobody has to guess whether a pid in a file is still alive. The lock
files live in ``OUT/.locks/`` (not inside the run folder, which may be renamed aside).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional

from multigpu import validate
from multigpu.fileio import Folder, ensure_real_folder


class RunLock:
    def __init__(self, root: Path, name: str) -> None:
        self.path = Path(root) / ".locks" / f"{name}.lock"
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the lock without waiting; False if another process holds it."""
        if self._fd is not None:
            return True
        ensure_real_folder(self.path.parent, "lock folder")
        fd = Folder(self.path.parent).open_lock(self.path.name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        """The pid written by the holder, for messages ("?" if unreadable)."""
        try:
            text = Folder(self.path.parent).load_text(self.path.name, limit=64).strip()
        except OSError:
            return "?"
        return text if validate.is_digits(text) else "?"

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None
