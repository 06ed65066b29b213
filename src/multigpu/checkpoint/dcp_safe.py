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
from typing import Any, Optional
from typing_extensions import override

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from multigpu.errors import CheckpointError

METADATA = ".metadata"
#: The only globals a DCP ``.metadata`` pickle may name (torch dtypes are admitted separately).
ALLOWED_GLOBALS = frozenset({
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
})


def _instance_types() -> tuple[type, ...]:
    """The only objects whose attributes a pickle may set (its BUILD opcode): DCP's metadata records."""
    from torch.distributed.checkpoint import filesystem, metadata

    return tuple(getattr(metadata, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                      "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                      "StorageMeta")) + (filesystem._StorageInfo,)


class _MetadataUnpickler(pickle._Unpickler):  # the Python implementation: its opcodes can be overridden
    """Admits only the globals of :data:`ALLOWED_GLOBALS` (and torch dtypes), and lets BUILD set
    attributes only on DCP's metadata records - otherwise BUILD on an admitted class (``PosixPath``)
    would rewrite that class for the rest of the process."""

    dispatch = dict(pickle._Unpickler.dispatch)

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
        raise CheckpointError(f"{self.source} refers to {module}.{name}, which is not checkpoint metadata: the file "
                              "would run code when loaded, and was refused.",
                              "do not use checkpoints from sources you do not trust; delete this one.")

    @override
    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source} uses pickle persistent ids, which DCP metadata never does.",
                              "do not use checkpoints from sources you do not trust; delete this one.")

    @override
    def load_build(self) -> None:
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if isinstance(target, type) or type(target) not in self.instance_types:
            raise CheckpointError(f"{self.source} sets attributes of {type(target).__name__ if not isinstance(target, type) else target.__name__}"
                                  ", which DCP metadata never does: refused.",
                                  "do not use checkpoints from sources you do not trust; delete this one.")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build


def read_metadata_file(path: Path) -> Metadata:
    """Unpickle ``path`` admitting only DCP metadata classes."""
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle, path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated, not a pickle, wrong protocol...
        raise CheckpointError(f"{path} is not readable checkpoint metadata ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:120]}).", "the checkpoint is corrupt; delete it.") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{path} does not hold DCP metadata.", "the checkpoint is corrupt; delete it.")
    return metadata


def check_metadata(metadata: Metadata, folder: Path, files: dict[str, int]) -> None:
    """Shards named by the metadata are files of the manifest (``files``: name -> size), and no tensor
    claims more bytes than the shards hold (a forged size would allocate without bound)."""
    try:
        _check_metadata(metadata, folder, files)
    except CheckpointError:
        raise
    except Exception as exc:  # a record of the wrong shape (a field None, a wrong type)
        raise CheckpointError(f"{folder}/{METADATA} is malformed ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:100]}).", "delete the checkpoint.") from None


def _check_metadata(metadata: Metadata, folder: Path, files: dict[str, int]) -> None:
    storage = getattr(metadata, "storage_data", None) or {}
    if not isinstance(storage, dict):
        raise CheckpointError(f"{folder}/{METADATA}: storage_data is not a mapping.", "delete the checkpoint.")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(name, str) or "/" in name or name not in files or not name.endswith(".distcp"):
            raise CheckpointError(f"{folder}/{METADATA} points to {str(name)[:80]!r}, which is not a shard of this "
                                  "checkpoint.", "the checkpoint is corrupt or tampered with; delete it.")
        if (not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0
                or offset + length > files[name]):
            raise CheckpointError(f"{folder}/{METADATA}: a shard range lies outside {name}.", "delete the checkpoint.")
        if getattr(info, "transform_descriptors", None):  # compression: could expand without bound
            raise CheckpointError(f"{folder}/{METADATA}: shards stored with transforms "
                                  f"({info.transform_descriptors!r}), which multigpu never writes.",
                                  "consolidate it with the tool that wrote it, or delete it.")
    shard_bytes = sum(size for name, size in files.items() if name.endswith(".distcp"))
    claimed = 0
    for entry in metadata.state_dict_metadata.values():
        if isinstance(entry, TensorStorageMetadata):
            size = getattr(entry, "size", None)
            if not isinstance(size, torch.Size) or any(d < 0 for d in size):
                raise CheckpointError(f"{folder}/{METADATA}: a tensor has an invalid size.", "delete the checkpoint.")
            claimed += math.prod(size) * torch.empty((), dtype=entry.properties.dtype).element_size()
    if claimed > 2 * shard_bytes + (1 << 20):
        raise CheckpointError(f"{folder}/{METADATA} claims {claimed:,} bytes of tensors but the shards hold "
                              f"{shard_bytes:,}.", "the checkpoint is corrupt or tampered with; delete it.")


class SafeReader(FileSystemReader):
    """DCP's file reader, handed metadata already read by :func:`read_checked_metadata` (so DCP never
    unpickles anything itself, and the file is read once: no window to swap it between check and use)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        if hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        return metadata


def read_checked_metadata(folder: Path, manifest: dict) -> Metadata:
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
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            text = str(exc).strip()
            first = text.splitlines()[0].split(". ")[0] if text else type(exc).__name__
            self.refusal = CheckpointError(
                f"a non-tensor checkpoint entry was refused: it is not plain data ({first[:150]}).",
                "do not use checkpoints from sources you do not trust; delete this one.")
            raise self.refusal from None
        clean = io.BytesIO()
        torch.save(obj, clean)  # plain data now: DCP's own (unsafe) load of it is harmless
        clean.seek(0)
        super().load_bytes(read_item, clean)  # type: ignore[misc]


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner (into an existing state dict), non-tensor entries loaded safely."""


def manifest_sizes(manifest: dict) -> dict[str, int]:
    return {name: int(entry["size"]) for name, entry in manifest["files"].items()}


def last_line(exc: BaseException) -> str:
    """The telling line of an exception DCP wrapped (its text holds every rank's traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    return (lines[-1] if lines else type(exc).__name__)[:300]
