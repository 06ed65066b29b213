"""A worker's stderr, byte for byte, to the launcher's stderr and to a per-rank file for failure reports.

Why not torch elastic's tee: it re-reads the per-rank file line by line and prints each line with a
``[rankN]:`` prefix, so every carriage return of a progress bar (tqdm, rich) becomes a new line (146
lines where torchrun shows 35 in-place redraws). Here each worker writes into a pseudo-terminal when
the launcher's stderr is a terminal (so libraries still see a terminal and draw their bars) or into a
pipe otherwise, and this small process copies the raw bytes on - carriage returns and ANSI colours
intact, a prefix only if asked for - and appends them to the rank's file. It is a separate process so
that the last bytes of a worker that crashed or was killed are still copied; it ignores Ctrl-C and
ends when the last writer closes its end, or a second after its worker is gone (a child the script
started may keep the stream open: it is not waited for).

Standard library and ``multigpu.fileio`` only: ``python -m multigpu.launch.tee FD FILE [PREFIX]``.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time


def copy(
    source: int,
    sink: int,
    log_path: str,
    prefix: bytes = b"",
    parent: int = 0,
    drain_s: float = 1.0,
) -> None:
    """Copy until the last writer closes. ``parent``: the worker's pid - once it is gone (a child it
    started may still hold the stream open), copy what arrives for ``drain_s`` more and stop."""
    from pathlib import Path

    from multigpu.fileio import Folder, open_devnull

    at_line_start = True
    deadline = None
    path = Path(log_path)
    try:
        log = Folder(path.parent).open_append_bytes(path.name)  # a planted link or FIFO is refused
    except OSError as exc:  # the terminal still gets every byte; only the per-rank copy is lost
        os.write(
            2,
            f"multigpu: not keeping a copy of this rank's {path.suffix[1:] or 'output'} in {log_path}: "
            # stderr: never into the script's stdout
            f"{exc.strerror or exc}\n".encode(errors="replace"),
        )
        log = os.fdopen(open_devnull(), "ab", buffering=0)
    with log:
        while True:
            ready, _, _ = select.select([source], [], [], 0.5)
            if not ready:
                if deadline is None and parent and os.getppid() != parent:
                    deadline = time.monotonic() + drain_s
                if deadline is not None and time.monotonic() >= deadline:
                    break
                continue
            try:
                data = os.read(source, 65536)
            except OSError:  # EIO: a pseudo-terminal whose last writer closed
                break
            if not data:
                break
            log.write(data)
            if prefix:
                out = bytearray()
                for byte in data:
                    end_of_line = byte in (10, 13)  # \n or \r: a bar's redraw starts after the \r
                    if at_line_start and not end_of_line:
                        out += prefix
                    out.append(byte)
                    at_line_start = end_of_line
                data = bytes(out)
            while data:
                try:
                    written = os.write(sink, data)
                except OSError:  # the launcher's stderr went away: keep the file copy going
                    break
                data = data[written:]


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)  # stop when the worker's end closes, never before it
    source, log_path = int(argv[0]), argv[1]
    prefix = argv[2].encode() if len(argv) > 2 else b""
    copy(source, sys.stdout.fileno(), log_path, prefix, parent=os.getppid())


if __name__ == "__main__":
    main(sys.argv[1:])
