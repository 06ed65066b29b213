"""Hang watchdog: when no step finishes for ``timeout_s``, write where every rank is stuck, then exit.

Why: a silent hang is the worst DDP failure - one rank blocked in its data loader, the others waiting
in an all-reduce, nothing printed until a 30-minute collective timeout (or never). Each rank runs a
daemon thread that the training loop feeds with ``beat()`` (one float store, nothing else). When the
beats stop, every rank dumps its Python stacks (faulthandler) to ``<folder>/rank<N>.txt`` and a one-line
summary of where its main thread is; rank 0 gathers the summaries into ``<folder>/report.txt`` and
prints it; every rank then exits with :data:`EXIT_HANG`, so the launcher stops the job: no orphans.

The files go through the filesystem, not a collective: a hung collective is what we are reporting.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator, Optional

from multigpu.errors import EXIT_HANG, visible
from multigpu.fileio import Folder

_KINDS = (
    ("torch/utils/data", "in the data loader"),
    ("torch/distributed", "in a collective (all_reduce/barrier/broadcast)"),
    ("torch/nn/parallel/distributed", "in DDP (gradient synchronisation)"),
    ("torch/autograd", "in backward (DDP's gradient all-reduce runs here)"),
    ("torch/_tensor.py", "in backward (DDP's gradient all-reduce runs here)"),
    ("multigpu/guards/preemption", "waiting for the other ranks' stop flags"),
    (
        "multigpu/distributed/agreement",
        "waiting for the other ranks to agree (a stop, a stream's end)",
    ),
    ("multigpu/checkpoint", "writing or reading a checkpoint"),
)


def where(frame_stack: list[traceback.FrameSummary]) -> str:
    """A short description of a stack: what the thread is doing and the innermost user line."""
    kind = "in user code"
    for frame in reversed(frame_stack):
        path = frame.filename.replace(os.sep, "/")
        for marker, label in _KINDS:
            if marker in path:
                kind = label
                break
        else:
            continue
        break
    user = [
        f
        for f in frame_stack
        if "site-packages" not in f.filename and "/multigpu/" not in f.filename.replace(os.sep, "/")
    ]
    last = (user or frame_stack)[-1] if frame_stack else None
    at = f" at {Path(last.filename).name}:{last.lineno} in {last.name}()" if last else ""
    return kind + at


class HangWatchdog:
    """``notice_s``: after that long without a step, one line on rank 0 naming where every rank is (the
    report and the exit still wait for ``timeout_s``): a stuck rank is named in a minute, not in 15."""

    def __init__(
        self,
        timeout_s: float,
        folder: Path,
        rank: int,
        world_size: int,
        grace_s: float = 5.0,
        exit: Callable[[int], None] = os._exit,
        notice_s: Optional[float] = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.notice_s = notice_s if notice_s is not None and notice_s < timeout_s else None
        # the beat a notice was given for: one notice per stall
        self._noticed: Optional[float] = None
        self.folder = Path(folder)
        self.rank = rank
        self.world_size = world_size
        self.grace_s = grace_s
        self._exit = exit
        self._last = time.monotonic()
        self._step = 0
        self._paused = 0
        self._stop = threading.Event()
        self._main = threading.main_thread()
        self._thread: Optional[threading.Thread] = None

    def beat(self, step: int = 0) -> None:
        """Record progress (called once per training step; costs two attribute stores)."""
        self._last = time.monotonic()
        self._step = step

    def start(self) -> "HangWatchdog":
        root = Folder(self.folder)
        for name in (
            f"rank{self.rank}.stack",
            f"rank{self.rank}.summary",
            f"rank{self.rank}.notice",
        ) + (("report.txt",) if self.rank == 0 else ()):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                root.remove(name)  # a report of an earlier hang must not be read as this one
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="multigpu-watchdog", daemon=True)
        self._thread.start()
        return self

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No hang report while inside (a long checkpoint write, a user hook); the clock restarts after."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        interval = max(0.05, min(self.timeout_s / 4, (self.notice_s or self.timeout_s) / 4, 5.0))
        while not self._stop.wait(interval):
            last = self._last
            idle = time.monotonic() - last
            if self._paused:
                continue
            if idle >= self.timeout_s:
                self._report(idle)
                self._exit(EXIT_HANG)
                return
            if self.notice_s is not None and idle >= self.notice_s and self._noticed != last:
                self._noticed = last
                # a notice that cannot be written is not a reason to stop
                with contextlib.suppress(OSError):
                    self._notice(idle)

    def _here(self) -> str:
        ident = self._main.ident  # None only for a thread not started
        frame = sys._current_frames().get(ident) if ident is not None else None
        return where(traceback.extract_stack(frame)) if frame is not None else "main thread gone"

    # -------------------------------------------------------------- the notice
    def _notice(self, idle: float) -> None:
        """Every rank writes where it is; rank 0 prints them in one line, ranks grouped by place."""
        root = Folder(self.folder).create()
        root.write_atomic(f"rank{self.rank}.notice", f"{time.time():.3f} {self._here()}\n")
        if self.rank != 0:
            return
        places: dict[int, str] = {}
        deadline = time.monotonic() + self.grace_s
        while len(places) < self.world_size and time.monotonic() < deadline:
            for r in set(range(self.world_size)) - set(places):
                with contextlib.suppress(OSError, ValueError):
                    stamp, _, place = (
                        root.load_text(f"rank{r}.notice", limit=4096).strip().partition(" ")
                    )
                    # written in this stall, not an earlier one
                    if float(stamp) >= time.time() - idle - self.grace_s:
                        places[r] = place
            time.sleep(0.05)
        groups: dict[str, list[int]] = {}
        for r in sorted(places):
            groups.setdefault(places[r], []).append(r)
        silent = [r for r in range(self.world_size) if r not in places]
        parts = [f"{_ranks(ranks)} {place}" for place, ranks in groups.items()]
        if silent:
            parts.append(f"{_ranks(silent)} said nothing (stuck holding the GIL, or gone)")
        sys.stderr.write(
            visible(
                f"multigpu: no training step for {idle:.0f} s after step {self._step}: "
                f"{'; '.join(parts)}. The watchdog reports and ends the job at {self.timeout_s:g} s "
                "(hang_timeout_s)."
            )
            + "\n"
        )
        sys.stderr.flush()

    # -------------------------------------------------------------- the report
    def _report(self, idle: float) -> None:
        root = Folder(self.folder).create()
        summary = self._here()
        line = f"rank {self.rank}: no progress for {idle:.0f} s after step {self._step}, {summary}"
        with root.open_new(f"rank{self.rank}.stack") as handle:  # renamed into place when complete
            handle.write((line + "\n\n").encode())
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
        root.write_atomic(f"rank{self.rank}.summary", line + "\n")
        if self.rank == 0:
            summaries = self._collect(root)
            text = (
                f"multigpu: hang detected - no training step finished for {self.timeout_s:g} s.\n"
                + "\n".join(summaries)
                + f"\nfull stacks: {self.folder}/rank<N>.stack\n"
            )
            root.write_atomic("report.txt", text)
            sys.stderr.write(visible(text, keep_newlines=True))
        else:
            deadline = time.monotonic() + self.grace_s * 2
            while root.kind("report.txt") is None and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.stderr.write(visible(line) + "\n")
        sys.stderr.flush()

    def _collect(self, root: Folder) -> list[str]:
        deadline = time.monotonic() + self.grace_s
        lines: dict[int, str] = {}
        while time.monotonic() < deadline and len(lines) < self.world_size:
            for r in range(self.world_size):
                if r in lines:
                    continue
                with contextlib.suppress(OSError):
                    text = root.load_text(f"rank{r}.summary", limit=4096).strip()
                    if text:
                        lines[r] = text
            time.sleep(0.05)
        silent = [r for r in range(self.world_size) if r not in lines]
        out = [lines[r] for r in sorted(lines)]
        if silent:
            out.append(
                f"ranks {silent} wrote no report within {self.grace_s:g} s (dead, or stuck holding the GIL)"
            )
        return out


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2, 5``: runs of consecutive ranks shortened, for lines about many ranks."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(
        f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs
    )
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"
