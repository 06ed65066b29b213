"""Profiling a run: torch.profiler traces per rank, and a CUDA memory snapshot when a step runs out of memory.

Why in the Trainer: the question "where does my step's time go, on every rank?" should cost a setting
(``profile: {wait: 1, warmup: 1, active: 3}``) or a flag (``multigpu run --profile``), not a rewrite of the
loop. The schedule counts optimizer steps (torchtitan's profiler does the same): ``wait`` steps untraced,
``warmup`` steps traced and thrown away (the profiler's own start-up), ``active`` steps kept, ``repeat``
times. Each rank writes its trace - Chrome trace JSON, which chrome://tracing, https://ui.perfetto.dev
and TensorBoard's profiler plugin read - into ``out_dir/profile`` as ``rank<R>-step<N>.pt.trace.json``;
rank 0 prints where, and its top operators by self time. Off, nothing is created and the loop calls
nothing: a step costs exactly what it did.

The memory snapshot (``memory_snapshot_on_oom: true``, CUDA only) records every allocation with its Python
stack while training (``torch.cuda.memory._record_memory_history``, at most :data:`MAX_ENTRIES` events) and,
when a step raises ``torch.OutOfMemoryError``, writes ``memory-snapshot-rank<R>.pickle`` next to the traces
(drag it into https://pytorch.org/memory_viz) before the error goes on.

Files go through the file door (:class:`multigpu.fileio.Folder`): the profiler writes into a fresh
temporary name inside a real folder, renamed into place.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from multigpu.fileio import Folder

#: Allocation events a memory snapshot keeps (a ring buffer: the newest).
MAX_ENTRIES = 100_000
FOLDER = "profile"


class StepProfiler:
    """torch.profiler driven by optimizer steps; ``start()`` before the first, ``step()`` after each."""

    def __init__(
        self,
        settings: Mapping[str, Any],
        out_dir: Path,
        rank: int,
        is_main: bool,
        device: torch.device,
        say: Callable[[str], None] = print,
    ) -> None:
        self.settings = dict(settings)
        self.folder = Folder(out_dir).child(FOLDER)
        self.rank = rank
        self.is_main = is_main
        self.cuda = device.type == "cuda"
        self.say = say
        self.written: list[Path] = []
        self._profiler: Any = None
        self._offset = 0

    def start(self, steps_done: int = 0) -> None:
        """``steps_done``: optimizer steps before this fit (a resume): traces are named by the run's step."""
        self._offset = steps_done
        from torch.profiler import ProfilerActivity, profile, schedule

        s = self.settings
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profiler = profile(
            activities=activities,
            on_trace_ready=self._ready,
            schedule=schedule(
                wait=s["wait"], warmup=s["warmup"], active=s["active"], repeat=s["repeat"]
            ),
            record_shapes=s["record_shapes"],
            profile_memory=s["profile_memory"],
            with_stack=s["with_stack"],
        )
        self._profiler.start()

    def step(self) -> None:
        self._profiler.step()

    def stop(self) -> None:
        """At the end of fit (a partly recorded window is written too)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        if not self.written and self.is_main:
            s = self.settings
            self.say(
                f"multigpu: profile: the run ended before step {self._offset + s['wait'] + s['warmup'] + 1}, "
                "where tracing starts; no trace written"
            )

    def _ready(self, profiler: Any) -> None:
        """The profiler's ``on_trace_ready``: this rank's trace into the folder; rank 0 says where and what."""
        last = self._offset + profiler.step_num
        name = f"rank{self.rank}-step{last}.pt.trace.json"
        temporary = f".{name}.{uuid.uuid4().hex}.tmp"
        profiler.export_chrome_trace(str(self.folder / temporary))
        self.folder.remove(name)
        self.folder.move(temporary, name)
        self.written.append(self.folder / name)
        if self.is_main:
            first = max(self._offset + 1, last - self.settings["active"] + 1)
            self.say(
                f"multigpu: profile: steps {first}-{last} traced on every rank: "
                f"{self.folder / f'rank*-step{last}.pt.trace.json'} (open in https://ui.perfetto.dev "
                f"or chrome://tracing, or `tensorboard --logdir {self.folder.path}` with torch-tb-profiler)"
            )
            if self.settings["top"]:
                key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
                self.say(
                    f"multigpu: profile: rank 0's top operators by {key}:\n"
                    + profiler.key_averages().table(sort_by=key, row_limit=self.settings["top"])
                )


@contextlib.contextmanager
def snapshot_on_oom(
    out_dir: Path, rank: int, device: torch.device, say: Callable[[str], None] = print
) -> Iterator[None]:
    """Record CUDA allocations inside; on ``torch.OutOfMemoryError`` write this rank's snapshot, then re-raise."""
    if device.type != "cuda":
        say(
            "multigpu: memory_snapshot_on_oom records CUDA allocations; this run is on the "
            f"{device.type}: no snapshot"
        )
        yield
        return
    torch.cuda.memory._record_memory_history(
        max_entries=MAX_ENTRIES, stacks="python", device=device
    )
    try:
        yield
    except torch.OutOfMemoryError:
        path = write_snapshot(out_dir, rank, torch.cuda.memory._snapshot(device))
        print(
            f"multigpu: out of memory on rank {rank}: memory snapshot in {path} "
            "(open it at https://pytorch.org/memory_viz)",
            file=sys.stderr,
            flush=True,
        )
        raise
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)


def write_snapshot(out_dir: Path, rank: int, snapshot: Any) -> Path:
    """A memory snapshot as the viewer reads it (pickle protocol 4), through the file door."""
    folder = Folder(out_dir).child(FOLDER)
    name = f"memory-snapshot-rank{rank}.pickle"
    folder.write_atomic(name, pickle.dumps(snapshot, protocol=4))
    return folder / name
