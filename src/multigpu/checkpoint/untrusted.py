"""Bytes received with a checkpoint, checked with limits before any object is built from them.

Why: a checkpoint folder travels (copied from a cluster, shared, downloaded), and loading it parses
two formats an attacker controls: pickles (DCP's ``.metadata``, the ``data.pkl`` inside every
``torch.save`` zip) and zip archives (``state.pt``, ``extra.pt``). Allow-listing the classes a pickle
may name stops code execution, not resource exhaustion: with allowed classes only, a 1 MB pickle can
nest a tuple a million levels deep (the interpreter crashes hashing it), name one 1 MiB string 2,000
times in a path (2 GB when joined), or repeat one object 200,000 times; a zip record stored deflated
expands 1 MB into 1 GB. So before anything is unpickled or ``torch.load`` runs:

- :func:`scan_pickle` walks the opcodes (``pickletools.genops``, which builds nothing) simulating the
  stack, and bounds the opcode count, string lengths, nesting depth and the size the object graph would
  have with every shared reference expanded. A memoised object that is changed after it was shared (the
  only way to cheat the depth count) is refused; our writers never do it.
- :func:`check_zip` reads a zip's central directory and local headers: every record stored (never
  compressed), inside the file, not overlapping another, with a bounded name; then scans its
  ``data.pkl`` with :func:`scan_pickle`.

Each refusal is a :class:`~multigpu.errors.CheckpointError` (one line): the checkpoint is skipped like
a torn one. Standard library only.
"""

from __future__ import annotations

import io
import pickletools
import struct
from dataclasses import dataclass
from typing import IO, Any, Optional

from multigpu.errors import CheckpointError


@dataclass(frozen=True)
class PickleLimits:
    """Bounds for one pickle; the defaults fit checkpoints of models with millions of tensors."""

    max_bytes: int = 256 << 20
    max_ops: int = 20_000_000
    max_depth: int = 200
    max_string: int = 16 << 20
    #: The object graph's size with every shared reference counted again (1 per object + string bytes).
    max_expanded: int = 1 << 30


#: DCP metadata names tensors and files: no string of it is long, and its graph is small.
METADATA_LIMITS = PickleLimits(max_bytes=256 << 20, max_string=64 << 10, max_expanded=256 << 20)
#: ``data.pkl`` of a state.pt/extra.pt: plain containers and tensor references.
DATA_PKL_LIMITS = PickleLimits(max_bytes=256 << 20, max_string=16 << 20, max_expanded=1 << 30)

_HINT = "the checkpoint is corrupt or was tampered with; delete it (an earlier one is used)."
_LEAF = 0  # an immutable leaf: str, bytes, number, None, a global
_MUTABLE = 1  # list, dict, set, or an object built by REDUCE/NEWOBJ (BUILD/SETITEMS may change it)
_TUPLE = 2


class _Node:
    """One simulated object: its nesting depth and expanded size, and whether a GET or DUP shared it."""

    __slots__ = ("depth", "size", "kind", "shared")

    def __init__(self, depth: int, size: int, kind: int) -> None:
        self.depth, self.size, self.kind = depth, size, kind
        self.shared = False


class _Refused(Exception):
    pass


_MARK = object()


class _Simulator:
    """The pickle machine's stack and memo with :class:`_Node` in place of objects."""

    def __init__(self, limits: PickleLimits) -> None:
        self.limits = limits
        self.stack: list[_Node] = []
        self.marks: list[int] = []
        self.memo: dict[Any, _Node] = {}

    # --------------------------------------------------------------- stack
    def push(self, node: _Node) -> None:
        if node.depth > self.limits.max_depth:
            raise _Refused(f"nests deeper than {self.limits.max_depth} levels")
        if node.size > self.limits.max_expanded:
            raise _Refused(
                f"expands to more than {self.limits.max_expanded:,} units (shared references repeated)"
            )
        self.stack.append(node)

    def pop(self) -> _Node:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise _Refused("pops an empty stack")
        return self.stack.pop()

    def pop_mark(self) -> list[_Node]:
        if not self.marks:
            raise _Refused("uses a mark that was never set")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def top(self) -> _Node:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise _Refused("reads an empty stack")
        return self.stack[-1]

    def combine(self, items: list[_Node], kind: int) -> _Node:
        return _Node(
            1 + max((n.depth for n in items), default=0), 1 + sum(n.size for n in items), kind
        )

    def mutate(self, target: _Node, items: list[_Node]) -> None:
        """Items added to ``target`` (APPEND, SETITEM, BUILD). A target shared before is refused: its
        depth would be hidden in every place that shares it, and it is the only way to a cycle (an
        object can be among its own items only if a GET or DUP pushed it again). Python's pickler
        shares an object only once it is complete, so our files never do it."""
        if target.shared:
            raise _Refused(
                "changes an object after sharing it (a way to hide its depth or make a cycle)"
            )
        target.depth = max(target.depth, 1 + max((n.depth for n in items), default=0))
        target.size += sum(n.size for n in items)
        if target.depth > self.limits.max_depth:
            raise _Refused(f"nests deeper than {self.limits.max_depth} levels")
        if target.size > self.limits.max_expanded:
            raise _Refused(
                f"expands to more than {self.limits.max_expanded:,} units (shared references repeated)"
            )

    # --------------------------------------------------------------- one opcode
    def step(self, name: str, arg: Any) -> None:  # noqa: C901 - one branch per opcode family
        if name in ("PROTO", "FRAME", "STOP"):
            return
        if name == "MARK":
            self.marks.append(len(self.stack))
        elif name in _LEAVES:
            size = len(arg) if isinstance(arg, (str, bytes, bytearray)) else 1
            if size > self.limits.max_string:
                raise _Refused(
                    f"holds a string of {size:,} bytes (limit {self.limits.max_string:,})"
                )
            self.push(_Node(0, 1 + size, _LEAF))
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "STACK_GLOBAL":
                self.pop(), self.pop()
            self.push(_Node(0, 1, _LEAF))
        elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
            self.push(_Node(0, 1, _MUTABLE))
        elif name == "EMPTY_TUPLE":
            self.push(_Node(0, 1, _TUPLE))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            items = [self.pop() for _ in range(int(name[-1]))]
            self.push(self.combine(items, _TUPLE))
        elif name in ("TUPLE", "FROZENSET"):
            self.push(self.combine(self.pop_mark(), _TUPLE))
        elif name in ("LIST", "DICT"):
            self.push(self.combine(self.pop_mark(), _MUTABLE))
        elif name in ("APPEND", "SETITEM"):
            items = [self.pop() for _ in range(1 if name == "APPEND" else 2)]
            self.mutate(self.top(), items)
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            items = self.pop_mark()
            self.mutate(self.top(), items)
        elif name == "BUILD":
            state = self.pop()
            self.mutate(self.top(), [state])
        elif name in ("REDUCE", "NEWOBJ"):
            args, func = self.pop(), self.pop()
            self.push(self.combine([args, func], _MUTABLE))
        elif name == "NEWOBJ_EX":
            kwargs, args, cls = self.pop(), self.pop(), self.pop()
            self.push(self.combine([kwargs, args, cls], _MUTABLE))
        elif name in ("OBJ", "INST"):
            self.push(self.combine(self.pop_mark(), _MUTABLE))
        elif name in ("PERSID", "BINPERSID"):
            pid = self.pop() if name == "BINPERSID" else _Node(0, 1 + len(arg or ""), _LEAF)
            self.push(self.combine([pid], _LEAF))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            self.memo[arg] = self.top()
        elif name == "MEMOIZE":
            self.memo[len(self.memo)] = self.top()
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            node = self.memo.get(arg)
            if node is None:
                raise _Refused("refers to a memo entry that was never stored")
            node.shared = True
            self.push(node)
        elif name == "POP":
            self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            node = self.top()
            node.shared = True
            self.push(node)
        elif name in ("EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"):
            raise _Refused(f"uses the {name} opcode, which checkpoints never do")
        else:
            raise _Refused(f"uses the unknown opcode {name}")


_LEAVES = {
    "INT",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG",
    "LONG1",
    "LONG4",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
    "BINBYTES",
    "SHORT_BINBYTES",
    "BINBYTES8",
    "BYTEARRAY8",
    "NONE",
    "NEWTRUE",
    "NEWFALSE",
    "UNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "FLOAT",
    "BINFLOAT",
}


def scan_pickle(data: bytes, what: str, limits: PickleLimits = DATA_PKL_LIMITS) -> None:
    """Refuse (CheckpointError) a pickle that exceeds ``limits`` - without building any object of it."""
    if len(data) > limits.max_bytes:
        raise CheckpointError(
            f"{what} is {len(data):,} bytes of pickle (limit {limits.max_bytes:,}).", _HINT
        )
    machine = _Simulator(limits)
    ops = 0
    try:
        for opcode, arg, _pos in pickletools.genops(io.BytesIO(data)):
            ops += 1
            if ops > limits.max_ops:
                raise _Refused(f"has more than {limits.max_ops:,} opcodes")
            machine.step(opcode.name, arg)
            if opcode.name == "STOP":
                break
        else:
            raise _Refused("ends before its STOP opcode")
    except _Refused as exc:
        raise CheckpointError(f"{what} was refused before loading: it {exc}.", _HINT) from None
    except (
        ValueError,
        EOFError,
        struct.error,
        UnicodeDecodeError,
        OverflowError,
        MemoryError,
    ) as exc:
        raise CheckpointError(
            f"{what} is not a readable pickle ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:80]}).",
            _HINT,
        ) from None


# ---------------------------------------------------------------------------------------------- zips


@dataclass(frozen=True)
class ZipLimits:
    max_records: int = 2_000_000
    max_name: int = 4096
    max_central_directory: int = 512 << 20


_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"


@dataclass(frozen=True)
class ZipRecord:
    name: str
    method: int
    size: int
    compressed: int
    header_offset: int
    data_offset: int = 0


def _read_at(handle: IO[bytes], offset: int, length: int) -> bytes:
    handle.seek(offset)
    data = handle.read(length)
    if len(data) != length:
        raise _Refused(f"is cut short at byte {offset + len(data):,}")
    return data


def _directory(handle: IO[bytes], file_size: int, limits: ZipLimits) -> tuple[int, int, int]:
    """(records, central directory offset, size) from the end records (zip64 when present)."""
    tail_len = min(file_size, 22 + 65535)
    tail = _read_at(handle, file_size - tail_len, tail_len)
    at = tail.rfind(_EOCD)
    if at < 0 or at + 22 > len(tail):
        raise _Refused("has no end of central directory (not a zip)")
    _, _, _, _, records, cd_size, cd_offset, _ = struct.unpack("<4sHHHHIIH", tail[at : at + 22])
    locator_at = at - 20
    if locator_at >= 0 and tail[locator_at : locator_at + 4] == _EOCD64_LOCATOR:
        (eocd64_offset,) = struct.unpack("<Q", tail[locator_at + 8 : locator_at + 16])
        if eocd64_offset + 56 > file_size:
            raise _Refused("points its zip64 end record outside the file")
        record = _read_at(handle, eocd64_offset, 56)
        if record[:4] != _EOCD64:
            raise _Refused("has a damaged zip64 end record")
        records, cd_size, cd_offset = struct.unpack("<QQQ", record[32:56])
    if records > limits.max_records:
        raise _Refused(f"lists {records:,} records (limit {limits.max_records:,})")
    if cd_size > limits.max_central_directory or cd_offset + cd_size > file_size:
        raise _Refused("has a central directory outside the file or too large")
    return records, cd_offset, cd_size


def _zip64_sizes(extra: bytes, size: int, compressed: int, offset: int) -> tuple[int, int, int]:
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack("<HH", extra[at : at + 4])
        body = extra[at + 4 : at + 4 + length]
        if tag == 1:
            values = list(struct.unpack(f"<{len(body) // 8}Q", body[: len(body) // 8 * 8]))
            if size == 0xFFFFFFFF and values:
                size = values.pop(0)
            if compressed == 0xFFFFFFFF and values:
                compressed = values.pop(0)
            if offset == 0xFFFFFFFF and values:
                offset = values.pop(0)
        at += 4 + length
    return size, compressed, offset


def read_zip_records(
    handle: IO[bytes], file_size: int, limits: ZipLimits = ZipLimits()
) -> list[ZipRecord]:
    """The records of a zip, each checked: stored, inside the file, not overlapping another."""
    count, cd_offset, cd_size = _directory(handle, file_size, limits)
    directory = _read_at(handle, cd_offset, cd_size)
    records, at = [], 0
    for _ in range(count):
        if directory[at : at + 4] != _CENTRAL or at + 46 > len(directory):
            raise _Refused("has a damaged central directory")
        (method, _time, _date, _crc, compressed, size, name_len, extra_len, comment_len, offset) = (
            struct.unpack("<HHHIIIHHH8xI", directory[at + 10 : at + 46])
        )
        if name_len > limits.max_name:
            raise _Refused(f"names a record with {name_len:,} bytes")
        name = directory[at + 46 : at + 46 + name_len].decode("utf-8", errors="replace")
        extra = directory[at + 46 + name_len : at + 46 + name_len + extra_len]
        size, compressed, offset = _zip64_sizes(extra, size, compressed, offset)
        records.append(ZipRecord(name, method, size, compressed, offset))
        at += 46 + name_len + extra_len + comment_len
    placed = []
    for record in records:
        if record.method != 0 or record.size != record.compressed:
            raise _Refused(
                f"stores {record.name[:80]!r} compressed (method {record.method}); torch.save never does"
            )
        header = _read_at(handle, record.header_offset, 30)
        if header[:4] != _LOCAL:
            raise _Refused(f"has a damaged local header for {record.name[:80]!r}")
        local_method, name_len, extra_len = struct.unpack("<H16xHH", header[8:30])
        if local_method != 0:
            raise _Refused(f"stores {record.name[:80]!r} compressed in its local header")
        data_offset = record.header_offset + 30 + name_len + extra_len
        if data_offset + record.size > file_size:
            raise _Refused(f"says {record.name[:80]!r} reaches past the end of the file")
        placed.append(
            ZipRecord(record.name, 0, record.size, record.size, record.header_offset, data_offset)
        )
    ranges = sorted((r.header_offset, r.data_offset + r.size) for r in placed)
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        if start < end:
            raise _Refused("has records that overlap (one byte range read as several)")
    return placed


def check_zip(handle: IO[bytes], what: str, limits: PickleLimits = DATA_PKL_LIMITS) -> None:
    """A ``torch.save`` zip fit to be given to ``torch.load``: records stored and in place, one
    ``data.pkl`` that :func:`scan_pickle` accepts. Leaves ``handle`` at the start."""
    handle.seek(0, io.SEEK_END)
    size = handle.tell()
    try:
        records = read_zip_records(handle, size)
        pickles = [r for r in records if r.name.endswith("/data.pkl") or r.name == "data.pkl"]
        if len(pickles) != 1:
            raise _Refused(f"holds {len(pickles)} data.pkl records (torch.save writes one)")
        data: Optional[bytes] = None
        if pickles[0].size > limits.max_bytes:
            raise _Refused(
                f"has a data.pkl of {pickles[0].size:,} bytes (limit {limits.max_bytes:,})"
            )
        data = _read_at(handle, pickles[0].data_offset, pickles[0].size)
    except _Refused as exc:
        raise CheckpointError(f"{what} was refused before loading: it {exc}.", _HINT) from None
    finally:
        handle.seek(0)
    scan_pickle(data, f"{what} (its data.pkl)", limits)


def load_checked(
    handle: IO[bytes], what: str, map_location: Any = None, limits: PickleLimits = DATA_PKL_LIMITS
) -> Any:
    """``torch.load(weights_only=True)`` of a zip that :func:`check_zip` accepted: the one place a
    checkpoint's ``torch.save`` files are loaded."""
    import torch

    check_zip(handle, what, limits)
    return torch.load(handle, map_location=map_location, weights_only=True)
