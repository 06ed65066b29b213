"""How a run writes and reads its checkpoints, chosen once from its strategy: one file, or DCP shards.

Why an interface here and not branches in ``Run``: the two formats differ in who writes (rank 0
alone, or every rank), in what a model's state is (gathered full tensors, or each rank's shards) and
in what a load may trust. ``ReplicatedIO`` reads only ``state.pt`` (``weights_only=True``) - it never
looks at DCP metadata, so a folder carrying a planted ``.metadata`` is not read as sharded. ``ShardedIO``
reads DCP shards through :mod:`multigpu.checkpoint.dcp_safe`, and also takes a replicated checkpoint
(its model weights). Both write through the same atomic folder and manifest
(:mod:`multigpu.checkpoint.files`); which kind a folder holds is what its manifest says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Union

from torch import nn

from multigpu.checkpoint import files
from multigpu.checkpoint.background import Finished, PendingSave, Stager
from multigpu.checkpoint.names import clean_state_dict
from multigpu.errors import CheckpointError

Unwrap = Callable[[nn.Module], nn.Module]
#: Collects one object from every rank on rank 0 (a list there, None elsewhere).
Gather = Callable[[Any], Optional[list[Any]]]
Pending = Union[PendingSave, Finished]


class CheckpointIO(Protocol):
    #: Written into the manifest and shown by ``multigpu checkpoint list``.
    kind: str

    def save(
        self,
        directory: Path,
        step: int,
        model: Optional[nn.Module],
        optimizer: Any,
        rest: dict[str, Any],
        meta: dict[str, Any],
        gather: Optional[Gather] = None,
    ) -> Path:
        """Every rank calls this; returns once ``directory/step-N`` exists."""

    def start_save(
        self,
        directory: Path,
        step: int,
        model: Optional[nn.Module],
        optimizer: Any,
        rest: dict[str, Any],
        meta: dict[str, Any],
        stager: Stager,
        group: Any,
        after: Callable[[], None],
    ) -> Pending:
        """Every rank calls this; returns once the state is staged, the write goes on in the background
        (then ``after`` runs on rank 0: pruning)."""

    def load(
        self,
        path: Path,
        manifest: dict[str, Any],
        model: Optional[nn.Module],
        optimizer: Any,
        map_location: Any,
    ) -> dict[str, Any]:
        """Restore model and optimizer in place; return the rest of the saved state."""

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The model's full weights with plain names (a collective for sharded models)."""


def _misfit(path: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} does not fit this model/optimizer: {' '.join(str(exc).split())[:300]}",
        "resume with the same model configuration, or start a new out_dir.",
    )


class ReplicatedIO:
    """Every rank holds the whole model: rank 0 writes one ``state.pt`` that loads into a plain model."""

    kind = "replicated"

    def __init__(self, is_main: bool, unwrap: Unwrap) -> None:
        self.is_main = is_main
        self.unwrap = unwrap

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return clean_state_dict(self.unwrap(model).state_dict())

    def _plain(
        self, model: Optional[nn.Module], optimizer: Any, rest: dict[str, Any]
    ) -> dict[str, Any]:
        plain = dict(rest)
        if isinstance(model, nn.Module):
            plain["model"] = self.model_state(model)
        if optimizer is not None:
            plain["optimizer"] = optimizer.state_dict()
        return plain

    def save(
        self,
        directory: Path,
        step: int,
        model: Optional[nn.Module],
        optimizer: Any,
        rest: dict[str, Any],
        meta: dict[str, Any],
        gather: Optional[Gather] = None,
    ) -> Path:
        if self.is_main:
            return files.save_state(directory, step, self._plain(model, optimizer, rest), meta=meta)
        return Path(directory) / files.step_name(step)

    def start_save(
        self,
        directory: Path,
        step: int,
        model: Optional[nn.Module],
        optimizer: Any,
        rest: dict[str, Any],
        meta: dict[str, Any],
        stager: Stager,
        group: Any,
        after: Callable[[], None],
    ) -> Pending:
        final = Path(directory) / files.step_name(step)
        if not self.is_main:
            return Finished(final)
        # a linked folder fails here, in the caller's thread
        files.Place.of(directory).require(create=True)
        staged = stager.stage(self._plain(model, optimizer, rest))

        def write() -> None:
            files.save_state(directory, step, staged, meta=meta)
            after()

        return PendingSave(final, write)

    def load(
        self,
        path: Path,
        manifest: dict[str, Any],
        model: Optional[nn.Module],
        optimizer: Any,
        map_location: Any,
    ) -> dict[str, Any]:
        if manifest.get("sharded"):
            raise CheckpointError(
                f"{path} is a sharded (DCP) checkpoint; this run's strategy keeps whole replicas and reads "
                "only single-file checkpoints.",
                "resume with the sharded strategy that wrote it (e.g. strategy: fsdp, any world size), or turn it "
                f"into one file with `multigpu checkpoint consolidate {path}`.",
            )
        state = files.load_state(path, map_location=map_location)
        try:
            if model is not None and "model" in state:
                self.unwrap(model).load_state_dict(state.pop("model"))
            if optimizer is not None and "optimizer" in state:
                optimizer.load_state_dict(state.pop("optimizer"))
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            raise _misfit(path, exc) from None
        return state


class ShardedIO:
    """Each rank holds shards: every rank writes its own through DCP; loads reshard to any layout."""

    kind = "sharded"

    def __init__(self, is_main: bool, barrier: Callable[[], None]) -> None:
        self.is_main = is_main
        self.barrier = barrier

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # pipeline stages: the other stages live on other ranks
        gathered = getattr(model, "full_state_dict", None)
        if callable(gathered):
            full: dict[str, Any] = gathered()
            return full
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return clean_state_dict(get_model_state_dict(model, options=options))

    def save(
        self,
        directory: Path,
        step: int,
        model: Optional[nn.Module],
        optimizer: Any,
        rest: dict[str, Any],
        meta: dict[str, Any],
        gather: Optional[Gather] = None,
    ) -> Path:
        if not isinstance(model, nn.Module):
            raise CheckpointError(
                "a sharded checkpoint needs the model under state['model'].",
                "call run.save_checkpoint(dir, step, {'model': model, 'optimizer': opt, ...}).",
            )
        # DCP and DTensor: ~0.8 s to import, only for sharded runs
        from multigpu.checkpoint import sharded

        return sharded.save(
            Path(directory),
            step,
            model,
            optimizer,
            rest,
            is_main=self.is_main,
            barrier=self.barrier,
            meta=meta,
            gather=gather,
        )

    def start_save(
        self,
        directory: Path,
        step: int,
        model: Optional[nn.Module],
        optimizer: Any,
        rest: dict[str, Any],
        meta: dict[str, Any],
        stager: Stager,
        group: Any,
        after: Callable[[], None],
    ) -> Pending:
        if not isinstance(model, nn.Module):
            raise CheckpointError(
                "a sharded checkpoint needs the model under state['model'].",
                "call run.save_checkpoint(dir, step, {'model': model, 'optimizer': opt, ...}).",
            )
        from multigpu.checkpoint import sharded

        return sharded.start_save(
            Path(directory),
            step,
            model,
            optimizer,
            rest,
            is_main=self.is_main,
            barrier=self.barrier,
            meta=meta,
            stager=stager,
            group=group,
            after=after,
        )

    def load(
        self,
        path: Path,
        manifest: dict[str, Any],
        model: Optional[nn.Module],
        optimizer: Any,
        map_location: Any,
    ) -> dict[str, Any]:
        if model is None:
            raise CheckpointError(
                f"{path} is loaded by a sharded strategy: it loads into a model, not into a dict.",
                "pass model= (and optimizer=), or consolidate it with `multigpu checkpoint consolidate`.",
            )
        from multigpu.checkpoint import sharded

        if manifest.get("sharded"):
            return sharded.load(
                path, model, optimizer, map_location=map_location, manifest=manifest
            )
        state = files.load_state(path, map_location=map_location)
        try:
            if "model" in state:
                sharded.load_full_into_sharded(model, state.pop("model"))
            state.pop("optimizer", None)
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            raise _misfit(path, exc) from None
        return state


def choose_io(
    sharded_strategy: bool, is_main: bool, barrier: Callable[[], None], unwrap: Unwrap
) -> CheckpointIO:
    """The one place that decides the format: from the strategy, once."""
    return ShardedIO(is_main, barrier) if sharded_strategy else ReplicatedIO(is_main, unwrap)
