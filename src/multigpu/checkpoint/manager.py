"""The save/resume choreography of one run: who writes, who chooses, what every rank gets back.

Why apart from the formats (``io``, ``files``, ``sharded``): which bytes go where is one question; the
order in which ranks take part is another, and it is where hangs and silent divergence come from.
Here: every rank's random streams and own state are gathered to rank 0 and saved with the rest; old
steps are pruned by rank 0 only, after the write; every rank returns once the folder exists (a
barrier). When resuming, rank 0 alone reads and verifies the folder listing and every other rank takes
its choice, so ranks never pick different steps from a lagging shared-filesystem listing; each rank
then restores its own random streams (old rank r's when the world size changed).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from multigpu.checkpoint import files, rng
from multigpu.checkpoint.background import Stager
from multigpu.checkpoint.io import CheckpointIO, Pending
from multigpu.distributed.session import DistSession
from multigpu.errors import CheckpointError


@dataclass
class CheckpointManager:
    """``io``: this run's format (from its strategy, asked for on use); ``quiet``: a context in which
    a long write is not reported as a hang; ``say``: prints on rank 0.

    Asynchronous saves (``asynchronous=True``) return once the state is staged; :meth:`wait` (called
    by the next save, the Trainer's end of fit and preemption, ``run.close()``) waits for the write.
    """

    session: DistSession
    io: Callable[[], CheckpointIO]
    quiet: Callable[[], ContextManager[None]]
    say: Callable[[str], None]
    _pending: Optional[Pending] = field(default=None, init=False, repr=False)
    _stager: Stager = field(default_factory=Stager, init=False, repr=False)
    _async_group: Any = field(default=None, init=False, repr=False)

    @property
    def _world(self) -> Any:
        return self.session.world

    def save(
        self,
        directory: Path,
        step: int,
        state: dict[str, Any],
        keep_last: Optional[int],
        meta: dict[str, Any],
        rank_state: Optional[dict[str, Any]],
        asynchronous: bool = False,
    ) -> Path:
        """Write ``state`` (model and optimizer as objects, the rest as values) atomically; every rank calls it.
        ``asynchronous``: return once it is staged in CPU memory (the path exists after :meth:`wait`)."""
        self.wait()  # at most one save in flight
        io = self.io()
        state = {**state, "ranks": self._gather_rank_states(rank_state)}
        model, optimizer = state.get("model"), state.get("optimizer")
        model = model if isinstance(model, nn.Module) else None
        rest = {
            k: (v.state_dict() if hasattr(v, "state_dict") and not isinstance(v, nn.Module) else v)
            for k, v in state.items()
            if k not in ("model", "optimizer")
        }
        directory = Path(directory)
        if asynchronous:
            with self.quiet():
                self._pending = io.start_save(
                    directory,
                    step,
                    model,
                    optimizer,
                    rest,
                    meta,
                    self._stager,
                    self._group_for_async(),
                    lambda: self._prune(directory, keep_last, step),
                )
            return self._pending.path
        with self.quiet():
            path = io.save(directory, step, model, optimizer, rest, meta, gather=self._gather)
            self._prune(directory, keep_last, step)
            self.session.barrier()
        return path

    def wait(self, agree: bool = True) -> Optional[Path]:
        """Wait for the save in flight, if any; its path, or None when there was none.

        ``agree``: every rank calls this at the same point and learns whether every rank's part worked
        (a failed write raises a CheckpointError on every rank); ``agree=False`` (Ctrl-C, an exception,
        teardown) waits for this rank's own write only and talks to nobody.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        with self.quiet():
            error = pending.join()
        problem = (
            None
            if error is None
            else f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        )
        if agree and self.session.active:
            problems: list[Any] = [None] * self._world.world_size
            dist.all_gather_object(problems, problem, group=self.session.control)
            problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(
                f"the asynchronous checkpoint {pending.path} was not written ({problem}).",
                "the previous checkpoint is still the newest good one; free disk space or check "
                "the folder, then resume.",
            )
        return pending.path

    def wait_quietly(self) -> None:
        """Wait for this rank's own write and talk to nobody (Ctrl-C, an exception, teardown); a failed
        write is reported, not raised (the run is already leaving for another reason)."""
        try:
            self.wait(agree=False)
        except CheckpointError as exc:
            warnings.warn(f"multigpu: {exc.message}", stacklevel=2)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def _prune(self, directory: Path, keep_last: Optional[int], step: int) -> None:
        if not self._world.is_main:
            return
        for moved in files.prune(directory, keep_last, newest=step):
            if moved.name.startswith("abandoned-"):
                self.say(
                    f"multigpu: moved {moved.name[len('abandoned-') :]} aside to {moved} "
                    f"(a later step than the one just saved: left by an abandoned run)"
                )

    def _group_for_async(self) -> Any:
        """A gloo group of its own for DCP's collectives on the writer thread (never the training's groups)."""
        if self._async_group is None and self.session.active:
            self._async_group = dist.new_group(
                backend="gloo", timeout=self.session.settings.timeout
            )
        return self._async_group

    def _gather(self, value: Any) -> Optional[list[Any]]:
        if not self.session.active:
            return [value]
        gathered: Optional[list[Any]] = (
            [None] * self._world.world_size if self._world.is_main else None
        )
        dist.gather_object(value, gathered, dst=0, group=self.session.control)
        return gathered

    def latest(self, directory: Path, checksums: bool = True) -> Optional[files.CheckpointInfo]:
        """The newest checkpoint that verifies, chosen by rank 0 and the same on every rank. A resume
        writes next, so rank 0 first finishes replacements a crash interrupted (``files.recover``)."""
        self.wait()
        info = self._choose(directory, checksums) if self._world.is_main else None
        if not self.session.active:
            return info
        box = [None if info is None else (str(info.path), info.step, info.meta)]
        dist.broadcast_object_list(box, src=0, group=self.session.control)
        if box[0] is None:
            return None
        path, step, manifest = box[0]
        return files.CheckpointInfo(Path(path), step, manifest)

    def _choose(self, directory: Path, checksums: bool) -> Optional[files.CheckpointInfo]:
        for path in files.recover(directory):
            self.say(f"multigpu: restored {path.name}, left aside by a save that was interrupted")
        return files.latest(directory, checksums=checksums, report=self.say)

    def load(
        self,
        where: "str | Path | files.CheckpointInfo",
        model: Optional[nn.Module],
        optimizer: Optional[torch.optim.Optimizer],
        device: torch.device,
    ) -> Optional[dict[str, Any]]:
        """A ``step-N`` folder (verified first), a folder of them (the newest good one) or what ``latest``
        returned; model and optimizer restored in place, the rest returned (None: no checkpoint)."""
        if isinstance(where, files.CheckpointInfo):
            path, manifest = where.path, where.meta
        else:
            path = Path(where)
            if not files.is_checkpoint(path):
                info = self.latest(path)
                if info is None:
                    return None
                path, manifest = info.path, info.meta
            else:  # what will be unpickled is checked by the format that reads it (io.load)
                manifest = files.verify(path, contents=False)
        state = self.io().load(path, manifest, model, optimizer, device)
        return self._restore_rank_states(state)

    # ------------------------------------------------------------------ per-rank state
    def _gather_rank_states(self, rank_state: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
        mine = {
            "rng": rng.capture(),
            "own": _to_cpu(rank_state) if rank_state is not None else None,
        }
        if not self.session.active:
            return [mine]
        gathered: Optional[list[Any]] = (
            [None] * self._world.world_size if self._world.is_main else None
        )
        dist.gather_object(mine, gathered, dst=0, group=self.session.control)
        return gathered if gathered is not None else []

    def _restore_rank_states(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's random streams from the checkpoint; its own state as ``state["rank_state"]``.
        When the world size changed, rank r takes old rank r's (ranks beyond take rank 0's streams)."""
        rank, size = self._world.rank, self._world.world_size
        # older: "rng"
        ranks = state.pop("ranks", None) or [{"rng": r} for r in state.pop("rng", None) or []]
        if not isinstance(ranks, list) or not all(isinstance(r, Mapping) for r in ranks):
            raise CheckpointError(
                "the checkpoint's per-rank states are malformed.",
                "it is corrupt; use an earlier one.",
            )
        if ranks and len(ranks) != size:
            # once
            self.say(
                f"multigpu: the checkpoint holds the state of {len(ranks)} rank(s), this run has {size}; "
                f"rank r takes old rank r's random streams and rank_state (ranks {len(ranks)} and up take rank "
                "0's streams and no rank_state)"
            )
        mine = ranks[rank] if rank < len(ranks) else (ranks[0] if ranks else None)
        if mine is not None and mine.get("rng") is not None:
            try:
                rng.restore(mine["rng"])
            except (
                KeyError,
                TypeError,
                ValueError,
                RuntimeError,
                AttributeError,
                IndexError,
            ) as exc:
                raise CheckpointError(
                    f"the checkpoint's random-generator states are malformed ({type(exc).__name__}).",
                    "it is corrupt; use an earlier one.",
                ) from None
        state["rank_state"] = ranks[rank].get("own") if rank < len(ranks) else None
        return state


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
