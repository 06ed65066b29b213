"""The one file door: every read and write of a run, queue or checkpoint folder goes through here.

Why: output folders travel - copied from a cluster, shared, received with their checkpoints. A
``checkpoints`` folder that is a symbolic link to someone else's folder would make pruning delete their
files; a ``curves.png.tmp.png`` link would make a plot overwrite any file; a ``status.json`` that is a
FIFO or ``/dev/zero`` would hang a reader or fill its memory. So:

- A :class:`Folder` is a root chosen by code or the command line (``out_dir``, ``--out``, ``--log-dir``);
  links in the root's own path are the user's business and followed. Everything *below* the root is
  reached one component at a time with ``O_NOFOLLOW`` (``openat``): a link anywhere below is refused,
  never followed, whatever the component.
- Folders we own (checkpoints, logs, tensorboard, best) are real folders: :meth:`Folder.child` creates
  them, and refuses a link or a file in their place.
- Reads accept regular files only, opened with ``O_NONBLOCK`` so a FIFO or device is refused before
  anything blocks, and are capped: ``limit`` bytes, no more.
- Writes go to a fresh temporary name created with ``O_EXCL | O_NOFOLLOW`` and are renamed over the
  target (a rename replaces a planted link, it never writes through it); appends refuse links and
  anything but a regular file.
- Deleting walks the tree by file descriptors and never leaves the folder.

Third-party writers (matplotlib, TensorBoard, W&B, MLflow, DCP) get a file object opened here, or a
path inside a real folder created and checked here. ``tests/test_security_doors.py`` fails when
src/multigpu opens, writes, renames or deletes a path anywhere else. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from pathlib import Path
from typing import IO, Iterator, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Reads without a limit of their own stop here (a status file, a log tail, a manifest).
DEFAULT_LIMIT = 16 << 20


class UnsafePath(OSError):
    """A link, FIFO, device or folder where a regular file or a real folder was expected, or a name that
    would leave its folder."""


def _refuse(path: PathLike, why: str, code: int = errno.ELOOP) -> UnsafePath:
    return UnsafePath(code, why, str(path))


def _parts(relative: PathLike) -> list[str]:
    """The components of a path inside a folder: no absolute paths, no ``..``, no empty names."""
    text = os.fspath(relative)
    if text.startswith("/") or "\x00" in text:
        raise _refuse(text, "is not a name inside the folder", errno.EINVAL)
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise _refuse(text, "leaves its folder (..)", errno.EINVAL)
    return parts


def _regular(fd: int, path: PathLike) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO, device or socket"
        raise _refuse(
            path,
            f"is {kind}, not a regular file",
            errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL,
        )


class Folder:
    """A folder and everything below it, reached without following links (see the module docstring).

    ``Folder(path)`` does not create anything; :meth:`create` does (the root, with its parents).
    """

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"Folder({str(self.path)!r})"

    def __truediv__(self, name: str) -> Path:
        """The path of ``name`` below this folder, for messages and for third-party writers."""
        return self.path.joinpath(*_parts(name))

    # ------------------------------------------------------------------ walking
    @contextlib.contextmanager
    def _dir(self, relative: PathLike = "", create: bool = False) -> Iterator[int]:
        """A descriptor of the folder ``relative`` below the root, each component opened without following
        links (``create``: missing components are made, as real folders)."""
        fd = os.open(self.path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        try:
            for part in _parts(relative):
                try:
                    child = os.open(
                        part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd
                    )
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    child = os.open(
                        part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd
                    )
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _refuse(
                            self.path / relative,
                            f"has {part!r} that is a link or a file, not a real "
                            "folder; refusing to go through it",
                        ) from None
                    raise
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def _split(self, relative: PathLike) -> tuple[str, str]:
        parts = _parts(relative)
        if not parts:
            raise _refuse(self.path, "names the folder itself, not a file in it", errno.EISDIR)
        return "/".join(parts[:-1]), parts[-1]

    # ------------------------------------------------------------------ folders
    def create(self) -> "Folder":
        """Make the root (and its parents) if missing; a root that is not a folder is refused."""
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def child(self, relative: PathLike) -> "Folder":
        """A real folder below this one, created if missing; a link or a file in its place is refused."""
        self.create()
        with self._dir(relative, create=True):
            pass
        return Folder(self.path.joinpath(*_parts(relative)))

    def store(
        self, relative: PathLike, max_entries: int = 200_000, inner_links: bool = False
    ) -> "Folder":
        """A folder below this one that another library will write into as it likes (TensorBoard's events,
        MLflow's file store, Optuna's study, W&B's run files), created if missing and checked whole first:
        every entry below it a real folder or a regular file of this user with no second name (a hard link
        to a file elsewhere would be written through), at most ``max_entries`` of them. A link, FIFO, device
        or socket planted anywhere in a received run folder - where the library would write through it - or
        a file of another user is refused before the library opens the store. ``inner_links``: links that
        stay inside the store are the library's own (W&B's ``latest-run``, its ``debug.log``)."""
        store = self.child(relative)
        root = os.path.join(os.path.realpath(store.path), "")
        uid, seen, pending = os.getuid(), 0, [store.path]
        while pending:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    seen += 1
                    if seen > max_entries:
                        raise _refuse(
                            store.path, f"holds more than {max_entries:,} entries", errno.EFBIG
                        )
                    info = entry.stat(follow_symlinks=False)
                    if (
                        stat.S_ISLNK(info.st_mode)
                        and inner_links
                        and os.path.join(os.path.realpath(entry.path), "").startswith(root)
                    ):
                        continue  # the library's own link to a place in its store
                    if stat.S_ISDIR(info.st_mode):
                        pending.append(Path(entry.path))
                    elif not stat.S_ISREG(info.st_mode):
                        raise _refuse(
                            entry.path, "is a link, FIFO, device or socket inside a store folder"
                        )
                    elif info.st_nlink > 1:
                        raise _refuse(
                            entry.path, "has another name (a hard link) inside a store folder"
                        )
                    if info.st_uid != uid:
                        raise _refuse(
                            entry.path, f"belongs to another user (uid {info.st_uid})", errno.EACCES
                        )
        return store

    def make(self, relative: PathLike) -> "Folder":
        """Create ``relative`` as a new, empty folder; FileExistsError if anything is there already."""
        folder, name = self._split(relative)
        with self._dir(folder, create=True) as fd:
            os.mkdir(name, 0o755, dir_fd=fd)
        return Folder(self.path.joinpath(*_parts(relative)))

    def is_folder(self, relative: PathLike = "") -> bool:
        """True if ``relative`` is a real folder (links below the root do not count)."""
        try:
            with self._dir(relative):
                return True
        except OSError:
            return False

    def only_folders_at(self, names: "tuple[str, ...]") -> bool:
        """True when each of ``names`` is a real folder or not there at all (nor any folder on its way)."""
        for name in names:
            parts = _parts(name)
            for depth in range(1, len(parts) + 1):
                try:
                    found = self.kind("/".join(parts[:depth]))
                except OSError:
                    return False
                if found is None:
                    break
                if found != "folder":
                    return False
        return True

    def entries(self, relative: PathLike = "") -> list[tuple[str, str]]:
        """``(name, kind)`` of each entry, kind "folder", "file", "link" or "other"; sorted by name."""
        out = []
        with self._dir(relative) as fd:
            for entry in os.scandir(fd):
                if entry.is_symlink():
                    kind = "link"
                elif entry.is_dir(follow_symlinks=False):
                    kind = "folder"
                elif entry.is_file(follow_symlinks=False):
                    kind = "file"
                else:
                    kind = "other"
                out.append((entry.name, kind))
        return sorted(out)

    def kind(self, relative: PathLike) -> Optional[str]:
        """ "folder", "file", "link", "other", or None when nothing is there."""
        folder, name = self._split(relative)
        try:
            with self._dir(folder) as fd:
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISLNK(mode):
            return "link"
        return "folder" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"

    def size(self, relative: PathLike) -> int:
        folder, name = self._split(relative)
        with self._dir(folder) as fd:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(self.path / relative, "is not a regular file", errno.EINVAL)
        return st.st_size

    # ------------------------------------------------------------------ reading
    @contextlib.contextmanager
    def open_read(self, relative: PathLike) -> Iterator[IO[bytes]]:
        """A regular file for streaming reads (checksums, ``torch.load``); links, FIFOs, devices refused."""
        folder, name = self._split(relative)
        with self._dir(folder) as dir_fd:
            try:
                fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise _refuse(self.path / relative, "is a symbolic link, not a file") from None
                raise
        try:
            _regular(fd, self.path / relative)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as handle:
            yield handle

    def load_bytes(self, relative: PathLike, limit: int = DEFAULT_LIMIT) -> bytes:
        """Up to ``limit + 1`` bytes (so callers can tell "too large")."""
        with self.open_read(relative) as handle:
            return handle.read(limit + 1)

    def load_text(self, relative: PathLike, limit: int = DEFAULT_LIMIT) -> str:
        """The text of a regular file of at most ``limit`` bytes (a larger one is refused)."""
        data = self.load_bytes(relative, limit)
        if len(data) > limit:
            raise _refuse(self.path / relative, f"is larger than {limit} bytes", errno.EFBIG)
        return data.decode("utf-8", errors="replace")

    def tail_lines(
        self, relative: PathLike, lines: int, max_bytes: int = 1 << 20
    ) -> tuple[list[str], int]:
        """The last ``lines`` lines read from the end (at most ``max_bytes``), and how many lines that part
        holds; ([], 0) if the file cannot be read safely."""
        try:
            with self.open_read(relative) as handle:
                handle.seek(0, os.SEEK_END)
                handle.seek(max(0, handle.tell() - max_bytes))
                text = handle.read(max_bytes).decode(errors="replace")
        except OSError:
            return [], 0
        found = text.split("\n")
        if found and found[-1] == "":
            found.pop()
        return found[-lines:] if lines else [], len(found)

    # ------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def open_new(
        self, relative: PathLike, fsync: bool = False, mode: int = 0o644
    ) -> Iterator[IO[bytes]]:
        """Write ``relative`` in one step: the caller writes into a fresh temporary file (``O_EXCL``,
        never a planted name), renamed over ``relative`` when the block ends without an error."""
        folder, name = self._split(relative)
        tmp = f".{name[:80]}.{uuid.uuid4().hex[:12]}.tmp"
        with self._dir(folder, create=True) as dir_fd:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
            try:
                os.fchmod(fd, mode)  # exactly this mode, whatever the umask
                with os.fdopen(fd, "wb") as handle:
                    yield handle
                    handle.flush()
                    if fsync:
                        os.fsync(handle.fileno())
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise

    def write_atomic(
        self, relative: PathLike, data: Union[str, bytes], fsync: bool = False, mode: int = 0o644
    ) -> None:
        """Replace ``relative`` with ``data``: readers see the old or the new file, never half of one."""
        with self.open_new(relative, fsync=fsync, mode=mode) as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)

    def open_append(self, relative: PathLike) -> IO[str]:
        """A text file opened for appending, created if missing; a link, FIFO or device is refused."""
        folder, name = self._split(relative)
        with self._dir(folder, create=True) as dir_fd:
            try:
                fd = os.open(
                    name,
                    os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC,
                    0o644,
                    dir_fd=dir_fd,
                )
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENXIO):
                    raise _refuse(
                        self.path / relative, "is a link or a FIFO; refusing to write through it"
                    ) from None
                raise
        try:
            _regular(fd, self.path / relative)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "a", encoding="utf-8", errors="replace")

    def open_append_bytes(self, relative: PathLike) -> IO[bytes]:
        """As :meth:`open_append`, unbuffered bytes (a copier of a worker's stderr)."""
        text = self.open_append(relative)
        fd = os.dup(text.fileno())
        text.close()
        return os.fdopen(fd, "ab", buffering=0)

    def open_lock(self, relative: PathLike) -> int:
        """A descriptor of a lock file (read-write, created if missing) for ``fcntl.flock``; a link, FIFO
        or device in its place is refused."""
        folder, name = self._split(relative)
        with self._dir(folder, create=True) as dir_fd:
            fd = os.open(
                name,
                os.O_RDWR | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC,
                0o644,
                dir_fd=dir_fd,
            )
        try:
            _regular(fd, self.path / relative)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # ------------------------------------------------------------------ moving and deleting
    def move(self, source: PathLike, target: PathLike) -> None:
        """Rename inside this folder (links are renamed as links, never followed); refuses to replace."""
        src_folder, src_name = self._split(source)
        dst_folder, dst_name = self._split(target)
        with self._dir(src_folder) as src_fd, self._dir(dst_folder, create=True) as dst_fd:
            with contextlib.suppress(FileNotFoundError):
                os.stat(dst_name, dir_fd=dst_fd, follow_symlinks=False)
                raise _refuse(
                    self.path / target, "already exists; refusing to replace it", errno.EEXIST
                )
            os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)

    def remove(self, relative: PathLike, missing_ok: bool = True) -> None:
        """Delete a file or a link (never what a link points to)."""
        folder, name = self._split(relative)
        try:
            with self._dir(folder) as fd:
                os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def remove_tree(self, relative: PathLike, missing_ok: bool = True) -> None:
        """Delete a folder and everything in it, walking by descriptors: links inside are deleted as
        links, and nothing outside this folder is ever touched."""
        folder, name = self._split(relative)
        try:
            with self._dir(folder) as fd:
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    _remove_tree_at(fd, name)
                else:
                    os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def fsync(self, relative: PathLike = "") -> None:
        """Make renames and new entries in ``relative`` durable (fsync of the folder)."""
        with self._dir(relative) as fd:
            os.fsync(fd)


def _remove_tree_at(parent_fd: int, name: str) -> None:
    fd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=parent_fd)
    try:
        for entry in list(os.scandir(fd)):
            if entry.is_dir(follow_symlinks=False):
                _remove_tree_at(fd, entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def inside(path: PathLike, root: Optional[PathLike]) -> bool:
    """True when ``path`` (links resolved) lies in ``root`` (None: no root to stay in)."""
    if root is None:
        return True
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------- one-off paths
# For a single file named by code or the command line (a hparams file, --log-dir's parent): the parent
# folder is the root, the file itself is never a link, FIFO or device.


def read_regular(path: PathLike, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of a regular file; a symbolic link, FIFO or device is refused."""
    path = Path(path)
    return Folder(path.parent).load_bytes(path.name, limit)


def atomic_write_text(path: PathLike, text: str, fsync: bool = False, mode: int = 0o644) -> None:
    """Replace ``path`` with ``text`` in one step (see :meth:`Folder.write_atomic`)."""
    path = Path(path)
    Folder(path.parent).write_atomic(path.name, text, fsync=fsync, mode=mode)


def write_file(path: PathLike, data: Union[str, bytes]) -> Path:
    """``mg.write_file``: a script's own output file (a run's config, its final metrics, a data split)
    written whole - readers see the old file or the new one, never half - and never through what is at
    its place: a link or a FIFO planted there (a run folder someone handed you) is replaced, never followed
    or opened; a folder there is refused. Its folder (the caller's to choose) is made if missing. Text is
    written as UTF-8. Returns the path."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")  # a lone surrogate fails here, before anything is written
    folder = Folder(path.parent)
    folder.create()
    if folder.kind(path.name) == "folder":
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
    folder.write_atomic(path.name, data)
    return path


def open_append(path: PathLike) -> IO[str]:
    """``path`` opened for appending (see :meth:`Folder.open_append`)."""
    path = Path(path)
    return Folder(path.parent).open_append(path.name)


def ensure_real_folder(path: PathLike, what: str = "folder") -> Path:
    """``path`` as a real folder, created with its parents; refused if it is a symbolic link."""
    path = Path(path)
    if path.is_symlink():
        raise _refuse(path, f"the {what} is a symbolic link; refusing to write through it")
    Folder(path.parent).create().child(path.name)
    return path


def tail_lines(path: PathLike, lines: int, max_bytes: int = 1 << 20) -> tuple[list[str], int]:
    """The last ``lines`` lines of a log file (see :meth:`Folder.tail_lines`)."""
    path = Path(path)
    return Folder(path.parent).tail_lines(path.name, lines, max_bytes)


def open_devnull() -> int:
    """A descriptor of /dev/null for writing (to close a stream without closing its descriptor number)."""
    return os.open(os.devnull, os.O_WRONLY | _CLOEXEC)
