"""What a hand-written loop calls to checkpoint: save, wait, find the newest good one, load.

Why apart from the Run: these four are the checkpoint choreography's face for a loop of your own
(the Trainer calls them too), with the Run's guards around each; what they do is in
:mod:`multigpu.checkpoint.manager`. The Run takes them as a mixin, so ``run.save_checkpoint`` stays one
name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from multigpu.checkpoint import files as checkpoint_files
from multigpu.checkpoint.manager import CheckpointManager
from multigpu.guards import Guards
from multigpu.strategies import Strategy


class RunParts(Protocol):
    """What these methods use of the Run."""

    _checkpoints: CheckpointManager
    guards: Guards

    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    def _need_strategy(self) -> Strategy: ...
    def _ensure_usable(self, doing: str = ...) -> None: ...
    def check_writable(self, folder: str | Path, what: str) -> Path: ...


class Checkpoints:
    """The Run's checkpoint methods (bring-your-own loop)."""

    def save_checkpoint(
        self: "RunParts",
        directory: str | Path,
        step: int,
        state: dict[str, Any],
        keep_last: Optional[int] = None,
        meta: Optional[dict[str, Any]] = None,
        rank_state: Optional[dict[str, Any]] = None,
        asynchronous: bool = False,
    ) -> Path:
        """Write ``state`` as an atomic, verified checkpoint; every rank calls this and returns after it exists.

        Put the model under ``"model"`` and the optimizer under ``"optimizer"``. Replicated strategies
        write one ``state.pt`` from rank 0 with a clean model state dict (loads into a plain model
        anywhere); sharded ones (fsdp, hsdp, fsdp+tp) write DCP shards from every rank, loadable at any
        world size. ``keep_last``: delete all but the newest so many (checkpoints of later steps, left
        by a run that was abandoned, are moved aside, never deleted).

        Every rank's random-generator states are saved too (and restored by ``load_checkpoint``), so a
        loop with dropout resumes exactly; ``rank_state``: this rank's own state (tensors to the CPU),
        given back to the same rank by ``load_checkpoint`` as ``state["rank_state"]``.

        ``asynchronous=True``: return as soon as the state is copied to CPU memory; a background thread
        writes it (the returned path exists after ``wait_for_checkpoint``). At most one is in flight: the
        next save, ``latest_checkpoint`` and ``close`` wait for it.
        """
        self._ensure_usable("saving a checkpoint")
        self.check_writable(directory, "the checkpoint folder")
        meta = {
            "world_size": self.world_size,
            "strategy": self._need_strategy().name,
            **(meta or {}),
        }
        return self._checkpoints.save(
            Path(directory), step, state, keep_last, meta, rank_state, asynchronous=asynchronous
        )

    def wait_for_checkpoint(
        self: "RunParts", then: Optional[Callable[[Path], Any]] = None
    ) -> Optional[Path]:
        """Wait for the asynchronous checkpoint in flight (every rank calls it); its path, or None when none
        was (``then(path)`` is called once it is written, with the hang watchdog paused). A write that
        failed on any rank raises a CheckpointError on every rank."""
        self._ensure_usable("waiting for a checkpoint")
        path = self._checkpoints.wait()
        if path is not None and then is not None:
            with self.guards.paused():
                then(path)
        return path

    def latest_checkpoint(
        self: "RunParts", directory: str | Path, checksums: bool = True
    ) -> Optional[checkpoint_files.CheckpointInfo]:
        """The newest checkpoint that verifies, chosen by rank 0 and the same on every rank.

        Rank 0 alone reads and checks the files (each skipped one is reported); the others take its
        choice, so ranks never pick different steps from a lagging shared-filesystem listing.
        """
        self._ensure_usable("choosing a checkpoint")
        return self._checkpoints.latest(Path(directory), checksums)

    def load_checkpoint(
        self: "RunParts",
        where: "str | Path | checkpoint_files.CheckpointInfo",
        model: Optional[nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
    ) -> Optional[dict[str, Any]]:
        """Load a checkpoint: ``where`` is a ``step-N`` folder, a folder of them (the newest good one), or
        what ``latest_checkpoint`` returned (already verified).

        With ``model``/``optimizer`` their states are restored in place, whatever the checkpoint's world
        size; the rest of the saved dict is returned. None when there is no checkpoint. A folder is
        verified against its manifest first, and read the way this run's strategy reads checkpoints.
        """
        self._ensure_usable("loading a checkpoint")
        return self._checkpoints.load(where, model, optimizer, self.device)
