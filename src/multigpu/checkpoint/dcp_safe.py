"""Read torch.distributed.checkpoint (DCP) folders without running code planted in them.

Why: DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` and its default
planner loads non-tensor entries (optimizer hyperparameters, counters) with
``torch.load(weights_only=False)`` - either runs whatever a tampered checkpoint holds. Here the
metadata goes through an unpickler that admits only DCP's own metadata classes (a planted object is
refused with a :class:`CheckpointError` naming it), every shard it points to must be a plain file
listed in the checkpoint's manifest, tensor sizes must fit in the shard bytes, and non-tensor entries
load with ``weights_only=True``. Tensors themselves DCP already loads with ``weights_only=True``.
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from typing_extensions import override

from multigpu.checkpoint.untrusted import METADATA_LIMITS, load_checked, scan_pickle
from multigpu.errors import CheckpointError, visible
from multigpu.fileio import Folder

METADATA = ".metadata"
#: The only globals a DCP ``.metadata`` pickle may name (torch dtypes are admitted separately).
ALLOWED_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


def _instance_types() -> tuple[type, ...]:
    """The only objects whose attributes a pickle may set (its BUILD opcode): DCP's metadata records."""
    from torch.distributed.checkpoint import filesystem, metadata

    return tuple(
        getattr(metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        )
    ) + (filesystem._StorageInfo,)


# the Python implementation: its opcodes can be overridden
class _MetadataUnpickler(pickle._Unpickler):
    """Admits only the globals of :data:`ALLOWED_GLOBALS` (and torch dtypes), and lets BUILD set
    attributes only on DCP's metadata records - otherwise BUILD on an admitted class (``PosixPath``)
    would rewrite that class for the rest of the process."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # pickle's own, set by load()

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source
        self.instance_types = _instance_types()

    @override
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{visible(str(self.source))} refers to {visible(f'{module}.{name}'[:120])}, "
            "which is not checkpoint metadata: the file would run code when loaded, and was refused.",
            "do not use checkpoints from sources you do not trust; delete this one.",
        )

    @override
    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(
            f"{visible(str(self.source))} uses pickle persistent ids, which DCP metadata never does.",
            "do not use checkpoints from sources you do not trust; delete this one.",
        )

    @override
    def load_build(self) -> None:  # type: ignore[misc]  # typeshed's pickle._Unpickler omits its opcodes' methods
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if isinstance(target, type) or type(target) not in self.instance_types:
            raise CheckpointError(
                f"{visible(str(self.source))} sets attributes of "
                f"{type(target).__name__ if not isinstance(target, type) else target.__name__}"
                ", which DCP metadata never does: refused.",
                "do not use checkpoints from sources you do not trust; delete this one.",
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]  # (not in typeshed, as above)

    dispatch[pickle.BUILD[0]] = load_build


def read_metadata_file(path: Path) -> Metadata:
    """Unpickle ``path`` admitting only DCP metadata classes, after :func:`scan_pickle` bounded its size,
    nesting, strings and expanded graph (so no allowed class can be used to exhaust memory or the stack)."""
    path = Path(path)
    shown = visible(str(path))
    try:
        with Folder(path.parent).open_read(path.name) as handle:
            data = handle.read(METADATA_LIMITS.max_bytes + 1)
    except OSError as exc:
        raise CheckpointError(
            f"{shown} is unreadable ({exc.strerror or exc}).",
            "the checkpoint is corrupt; delete it.",
        ) from None
    return parse_metadata(data, path)


def parse_metadata(data: bytes, path: Path) -> Metadata:
    """DCP metadata from bytes: scanned with limits, then unpickled admitting DCP's classes only."""
    shown = visible(str(path))
    scan_pickle(data, shown, METADATA_LIMITS)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated, not a pickle, wrong protocol...
        raise CheckpointError(
            f"{shown} is not readable checkpoint metadata ({type(exc).__name__}: "
            f"{visible(' '.join(str(exc).split())[:120])}).",
            "the checkpoint is corrupt; delete it.",
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(
        getattr(metadata, "state_dict_metadata", None), dict
    ):
        raise CheckpointError(
            f"{shown} does not hold DCP metadata.", "the checkpoint is corrupt; delete it."
        )
    return metadata


def check_metadata(metadata: Metadata, folder: Path, files: dict[str, int]) -> None:
    """Shards named by the metadata are files of the manifest (``files``: name -> size), and no tensor
    claims more bytes than the shards hold (a forged size would allocate without bound)."""
    try:
        _check_metadata(metadata, folder, files)
    except CheckpointError:
        raise
    except Exception as exc:  # a record of the wrong shape (a field None, a wrong type)
        raise _refuse(
            folder,
            f"is malformed ({type(exc).__name__}: {visible(' '.join(str(exc).split())[:100])}).",
        ) from None


#: Bounds on what one checkpoint's metadata may describe (far above any model we know of).
MAX_TENSORS = 1_000_000
MAX_CHUNKS_PER_TENSOR = 65_536
MAX_CHUNKS = 4_000_000
#: Pairs of chunks compared for overlaps, in all (a sweep keeps real layouts far below it).
MAX_COMPARISONS = 20_000_000


def _refuse(folder: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{visible(str(folder))}/{METADATA} {why}",
        "the checkpoint is corrupt or tampered with; delete it (an earlier one is used).",
    )


def _check_metadata(metadata: Metadata, folder: Path, files: dict[str, int]) -> None:
    storage = getattr(metadata, "storage_data", None) or {}
    if not isinstance(storage, dict):
        raise _refuse(folder, "has a storage_data that is not a mapping.")
    if len(metadata.state_dict_metadata) > MAX_TENSORS or len(storage) > MAX_CHUNKS:
        raise _refuse(
            folder, f"describes more than {MAX_TENSORS:,} entries or {MAX_CHUNKS:,} chunks."
        )
    ranges: dict[str, list[tuple[int, int]]] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if (
            not isinstance(name, str)
            or "/" in name
            or name not in files
            or not name.endswith(".distcp")
        ):
            raise _refuse(
                folder,
                f"points to '{visible(str(name)[:80]) if isinstance(name, str) else type(name).__name__}', "
                "which is not a shard of this checkpoint.",
            )
        if (
            not isinstance(offset, int)
            or not isinstance(length, int)
            or offset < 0
            or length < 0
            or offset + length > files[name]
        ):
            raise _refuse(folder, f"has a shard range outside {visible(name)}.")
        if getattr(info, "transform_descriptors", None):  # compression: could expand without bound
            raise _refuse(
                folder,
                "has shards stored with transforms (compression), which multigpu never writes.",
            )
        ranges.setdefault(name, []).append((offset, offset + length))
    for name, spans in ranges.items():
        spans.sort()
        if any(start < end for (_, end), (start, _) in zip(spans, spans[1:])):
            raise _refuse(
                folder, f"reads overlapping byte ranges of {visible(name)} (one chunk repeated?)."
            )
    shard_bytes = sum(size for name, size in files.items() if name.endswith(".distcp"))
    claimed, chunks, budget = 0, 0, [MAX_COMPARISONS]
    for entry in metadata.state_dict_metadata.values():
        if isinstance(entry, TensorStorageMetadata):
            size = getattr(entry, "size", None)
            if not isinstance(size, torch.Size) or any(d < 0 for d in size):
                raise _refuse(folder, "gives a tensor an invalid size.")
            claimed += (
                math.prod(size) * torch.empty((), dtype=entry.properties.dtype).element_size()
            )
            chunks += len(entry.chunks)
            if chunks > MAX_CHUNKS:
                raise _refuse(folder, f"describes more than {MAX_CHUNKS:,} chunks.")
            _check_chunks(entry.chunks, size, folder, budget)
    if claimed > 2 * shard_bytes + (1 << 20):
        raise _refuse(
            folder, f"claims {claimed:,} bytes of tensors but the shards hold {shard_bytes:,}."
        )


def _check_chunks(chunks: Any, size: torch.Size, folder: Path, budget: list[int]) -> None:
    """A tensor's chunks: few enough, inside it, not overlapping, and covering it exactly (a region read
    twice or never would load garbage - or take minutes: one chunk repeated 200,000 times)."""
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS_PER_TENSOR:
        raise _refuse(folder, f"gives a tensor more than {MAX_CHUNKS_PER_TENSOR:,} chunks.")
    boxes = []
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if (
            not isinstance(offsets, torch.Size)
            or not isinstance(sizes, torch.Size)
            or len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, size))
        ):
            raise _refuse(folder, "has a chunk outside its tensor.")
        boxes.append((tuple(offsets), tuple(o + s for o, s in zip(offsets, sizes))))
    if sum(math.prod(e - o for o, e in zip(lo, hi)) for lo, hi in boxes) != math.prod(size):
        raise _refuse(
            folder,
            "has chunks that do not cover their tensor exactly (repeated or missing chunks).",
        )
    if len(size) == 0:
        if len(boxes) > 1:
            raise _refuse(folder, "has a scalar stored more than once.")
        return
    boxes.sort()
    active: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []
    for lo, hi in boxes:
        active = [box for box in active if box[1][0] > lo[0]]
        for other_lo, other_hi in active:
            budget[0] -= 1
            if budget[0] < 0:
                raise _refuse(folder, "has too many chunks to compare for overlaps.")
            if all(max(a, b) < min(c, d) for a, b, c, d in zip(lo, other_lo, hi, other_hi)):
                raise _refuse(folder, "has overlapping chunks (one region stored twice).")
        active.append((lo, hi))


class SafeReader(FileSystemReader):
    """DCP's file reader, handed metadata already read by :func:`read_checked_metadata` (so DCP never
    unpickles anything itself, and the file is read once: no window to swap it between check and use)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata
        storage_meta = getattr(metadata, "storage_meta", None)  # absent from older metadata
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        if hasattr(self, "load_id"):
            storage_meta.load_id = self.load_id
        return metadata


def read_checked_metadata(folder: Path, manifest: dict[str, Any]) -> Metadata:
    """The folder's ``.metadata``, read safely and checked against the manifest's files."""
    metadata = read_metadata_file(Path(folder) / METADATA)
    check_metadata(metadata, Path(folder), manifest_sizes(manifest))
    return metadata


class _SafeBytes:
    """Non-tensor entries loaded with ``weights_only=True`` (DCP uses ``weights_only=False``).

    DCP wraps exceptions raised here in its own (with tracebacks in the text), so the refusal is also
    kept in ``refusal`` for the caller to raise as it is.
    """

    refusal: Optional[CheckpointError] = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = load_checked(value, "a non-tensor checkpoint entry")
        except CheckpointError as exc:
            self.refusal = exc
            raise
        except Exception as exc:
            text = str(exc).strip()
            first = text.splitlines()[0].split(". ")[0] if text else type(exc).__name__
            self.refusal = CheckpointError(
                f"a non-tensor checkpoint entry was refused: it is not plain data ({visible(first[:150])}).",
                "do not use checkpoints from sources you do not trust; delete this one.",
            )
            raise self.refusal from None
        clean = io.BytesIO()
        torch.save(obj, clean)  # plain data now: DCP's own (unsafe) load of it is harmless
        clean.seek(0)
        super().load_bytes(read_item, clean)  # type: ignore[misc]


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner (into an existing state dict), non-tensor entries loaded safely."""


def manifest_sizes(manifest: dict[str, Any]) -> dict[str, int]:
    return {name: int(entry["size"]) for name, entry in manifest["files"].items()}


def last_line(exc: BaseException) -> str:
    """The telling line of an exception DCP wrapped (its text holds every rank's traceback)."""
    lines = [
        line.strip()
        for line in str(exc).splitlines()
        if line.strip() and not line.startswith((" ", "Traceback"))
    ]
    return (lines[-1] if lines else type(exc).__name__)[:300]
