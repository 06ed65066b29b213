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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from multigpu.checkpoint import files, rng
from multigpu.checkpoint.io import CheckpointIO
from multigpu.distributed.session import DistSession
from multigpu.errors import CheckpointError


@dataclass
class CheckpointManager:
    """``io``: this run's format (from its strategy, asked for on use); ``quiet``: a context in which
    a long write is not reported as a hang; ``say``: prints on rank 0."""

    session: DistSession
    io: Callable[[], CheckpointIO]
    quiet: Callable[[], ContextManager]
    say: Callable[[str], None]

    @property
    def _world(self) -> Any:
        return self.session.world

    def save(self, directory: Path, step: int, state: dict, keep_last: Optional[int], meta: dict,
             rank_state: Optional[dict]) -> Path:
        """Write ``state`` (model and optimizer as objects, the rest as values) atomically; every rank calls it."""
        io = self.io()
        state = {**state, "ranks": self._gather_rank_states(rank_state)}
        model, optimizer = state.get("model"), state.get("optimizer")
        rest = {k: (v.state_dict() if hasattr(v, "state_dict") and not isinstance(v, nn.Module) else v)
                for k, v in state.items() if k not in ("model", "optimizer")}
        with self.quiet():
            path = io.save(Path(directory), step, model if isinstance(model, nn.Module) else None, optimizer, rest,
                           meta)
            if self._world.is_main:
                for moved in files.prune(directory, keep_last, newest=step):
                    if moved.name.startswith("abandoned-"):
                        self.say(f"multigpu: moved {moved.name[len('abandoned-'):]} aside to {moved} "
                                 f"(a later step than the one just saved: left by an abandoned run)")
            self.session.barrier()
        return path

    def latest(self, directory: Path, checksums: bool = True) -> Optional[files.CheckpointInfo]:
        """The newest checkpoint that verifies, chosen by rank 0 and the same on every rank."""
        info = files.latest(directory, checksums=checksums, report=self.say) if self._world.is_main else None
        if not self.session.active:
            return info
        box = [None if info is None else (str(info.path), info.step, info.meta)]
        dist.broadcast_object_list(box, src=0, group=self.session.control)
        if box[0] is None:
            return None
        path, step, manifest = box[0]
        return files.CheckpointInfo(Path(path), step, manifest)

    def load(self, where: "str | Path | files.CheckpointInfo", model: Optional[nn.Module],
             optimizer: Optional[torch.optim.Optimizer], device: torch.device) -> Optional[dict]:
        """A ``step-N`` folder (verified first), a folder of them (the newest good one) or what ``latest``
        returned; model and optimizer restored in place, the rest returned (None: no checkpoint)."""
        if isinstance(where, files.CheckpointInfo):
            path, manifest = where.path, where.meta
        else:
            path = Path(where)
            if not (path / files.MANIFEST).exists():
                info = self.latest(path)
                if info is None:
                    return None
                path, manifest = info.path, info.meta
            else:
                manifest = files.verify(path)
        state = self.io().load(path, manifest, model, optimizer, device)
        return self._restore_rank_states(state)

    # ------------------------------------------------------------------ per-rank state
    def _gather_rank_states(self, rank_state: Optional[dict]) -> list[dict]:
        mine = {"rng": rng.capture(), "own": _to_cpu(rank_state) if rank_state is not None else None}
        if not self.session.active:
            return [mine]
        gathered: Optional[list[Any]] = [None] * self._world.world_size if self._world.is_main else None
        dist.gather_object(mine, gathered, dst=0, group=self.session.control)
        return gathered if gathered is not None else []

    def _restore_rank_states(self, state: dict) -> dict:
        """This rank's random streams from the checkpoint; its own state as ``state["rank_state"]``.
        When the world size changed, rank r takes old rank r's (ranks beyond take rank 0's streams)."""
        rank, size = self._world.rank, self._world.world_size
        ranks = state.pop("ranks", None) or [{"rng": r} for r in state.pop("rng", None) or []]  # older: "rng"
        if not isinstance(ranks, list) or not all(isinstance(r, Mapping) for r in ranks):
            raise CheckpointError("the checkpoint's per-rank states are malformed.", "it is corrupt; use an earlier one.")
        if ranks and len(ranks) != size:
            warnings.warn(f"multigpu: the checkpoint holds the state of {len(ranks)} rank(s), this run has "
                          f"{size}; rank r takes old rank r's random streams and rank_state "
                          f"(ranks {len(ranks)} and up take rank 0's streams and no rank_state).", stacklevel=4)
        mine = ranks[rank] if rank < len(ranks) else (ranks[0] if ranks else None)
        if mine is not None and mine.get("rng") is not None:
            try:
                rng.restore(mine["rng"])
            except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as exc:
                raise CheckpointError(f"the checkpoint's random-generator states are malformed ({type(exc).__name__}).",
                                      "it is corrupt; use an earlier one.") from None
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
