"""The fork server's wire format, both ends (:mod:`.boot` the client, :mod:`.forkserver` the server).

A client sends one frame - an 8-byte big-endian length, then that much JSON - with its stdin, stdout and
stderr attached (SCM_RIGHTS), then lines ``{"signal": N}``; the server answers with JSON lines
(``{"pid": P}`` or ``{"plain": true}``, then ``{"status": WAITSTATUS}``). Standard library only: the
client is a small process that must start in ~0.1 s. The server checks every field before it acts on it
(a request is data from another process, never trusted).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from typing import Any, Optional

HEADER = struct.Struct(">Q")
MAX_FRAME = 16 << 20


def frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode()
    return HEADER.pack(len(data)) + data


class LineReader:
    """JSON lines from a stream socket (None at EOF)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, b""

    def next(self) -> Optional[dict[str, Any]]:
        while b"\n" not in self.buffer:
            try:
                chunk = self.sock.recv(4096)
            except OSError:
                return None
            if not chunk:
                return None
            self.buffer += chunk
            if len(self.buffer) > MAX_FRAME:
                return None
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            message = json.loads(line)
        except ValueError:
            return None
        return message if isinstance(message, dict) else None


def receive(conn: socket.socket, deadline: float) -> tuple[dict[str, Any], list[int]]:
    """One request: its frame and the three descriptors sent with it, whole before ``deadline``.
    ValueError (or OSError) for anything else."""
    conn.settimeout(max(deadline - time.monotonic(), 0.01))
    data, fds, _flags, _address = socket.recv_fds(conn, HEADER.size, 3)
    try:
        if len(fds) != 3:
            raise ValueError("a request comes with stdin, stdout and stderr")
        data += _exactly(conn, HEADER.size - len(data), deadline)
        (size,) = HEADER.unpack(data)
        if size > MAX_FRAME:
            raise ValueError("request too large")
        request = json.loads(_exactly(conn, size, deadline))
        if not (isinstance(request, dict) and _strings(request.get("argv")) and _strings(request.get("path"))
                and isinstance(request.get("env"), dict) and _strings(list(request["env"].items()), pairs=True)
                and isinstance(request.get("cwd"), str) and type(request.get("umask")) is int
                and 0 <= request["umask"] <= 0o777 and isinstance(request.get("closed"), list)
                and all(fd in (0, 1, 2) for fd in request["closed"])
                and request.setdefault("kind", "worker") in ("worker", "launcher")):
            raise ValueError("malformed request")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, list(fds)


def _strings(values: object, pairs: bool = False) -> bool:
    if not isinstance(values, list):
        return False
    items = [x for pair in values for x in pair] if pairs else values
    return all(isinstance(x, str) and "\0" not in x for x in items)


def _exactly(conn: socket.socket, size: int, deadline: float) -> bytes:
    chunks, left = [], size
    while left > 0:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise ValueError("request too slow")
        conn.settimeout(left_s)
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ValueError("connection closed mid-request")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
