"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank writes its shards,
and a checkpoint saved by N ranks loads on M ranks (or into a plain model in one process).

Why DCP: it stores each tensor with its global shape and the slices each file holds, so loading
reshards to whatever layout the target model has - FSDP on 3 ranks, or ordinary tensors - without
anyone gathering the whole model in one process. The folder is made atomic the same way as every
other checkpoint (temporary name, manifest with sizes and CRC-32, rename), by rank 0 after all ranks
finished writing. ``consolidate`` turns one into a single plain ``state.pt``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from multigpu.checkpoint.files import (
    STATE_FILE,
    finalize_folder,
    load_state,
    read_manifest,
    step_name,
    temporary_folder,
    verify,
    write_checkpoint_folder,
)
from multigpu.errors import CheckpointError

EXTRA_FILE = "extra.pt"
METADATA = ".metadata"
#: The manifest says so when the optimizer's state is flattened (per-parameter hyperparameters): written
#: since pipeline stages, whose ranks hold different parameters - one group list would keep only one
#: stage's (torchtitan saves it flattened for the same reason). Folders without it load as before.
FLAT_OPTIMIZER = "optimizer_flat"


def _options(flat: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flat)


def is_sharded(path: Path) -> bool:
    """What the manifest says the writer wrote - never guessed from the files that happen to be there."""
    return bool(read_manifest(Path(path)).get("sharded"))


def save(directory: Path, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], extra: dict,
         *, is_main: bool, barrier: Callable[[], None], meta: Optional[dict] = None) -> Path:
    """Every rank calls this. Shards go through DCP; ``extra`` (counters, RNG, scheduler) is written by rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, [optimizer] if optimizer is not None else [], options=_options(True))
    tmp = Path(directory) / f".tmp-{step_name(step)}-sharded"  # the same on every rank, without talking
    if is_main:
        temporary_folder(directory, step, unique=False)
    barrier()
    with warnings.catch_warnings():  # a world of one saves "in a single process": what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
    if is_main:
        torch.save(extra, tmp / EXTRA_FILE)
    barrier()
    final = Path(directory) / step_name(step)
    if is_main:
        final = finalize_folder(tmp, step, meta={**(meta or {}), "sharded": True, FLAT_OPTIMIZER: True})
    barrier()
    return final


def load(path: Path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
         map_location: Any = "cpu", manifest: Optional[dict] = None) -> dict:
    """Load shards into ``model``/``optimizer`` whatever their layout now; return the extra state.

    The metadata and non-tensor entries are read by :mod:`multigpu.checkpoint.dcp_safe`: a planted
    object is refused, not run.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from multigpu.checkpoint.dcp_safe import SafeLoadPlanner, SafeReader, last_line, read_checked_metadata

    manifest = manifest if manifest is not None else read_manifest(Path(path))
    metadata = read_checked_metadata(path, manifest)  # before DCP sees the folder: a planted object stops here
    optimizers = [optimizer] if optimizer is not None else []
    options = _options(bool(manifest.get(FLAT_OPTIMIZER)))
    model_state, optim_state = get_state_dict(model, optimizers, options=options)
    state = {"model": model_state, "optimizer": optim_state}
    planner = SafeLoadPlanner()
    try:
        with warnings.catch_warnings():  # "loading in a single process" is what we mean to do
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(path, metadata), planner=planner)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        if planner.refusal is not None:
            raise planner.refusal from None
        raise CheckpointError(f"cannot load the sharded checkpoint {path}: {last_line(exc)}",
                              "it was saved from a different model; resume with the same model configuration.") from None
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)
    return load_state(Path(path) / EXTRA_FILE, map_location=map_location)


def load_full_into_sharded(model: nn.Module, full_model_state: dict) -> None:
    """A replicated checkpoint (one ``state.pt``) into a sharded model: every rank keeps its slice."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, full_model_state, options=StateDictOptions(full_state_dict=True))
    warnings.warn("multigpu: loaded model weights from a replicated checkpoint into a sharded model; "
                  "the optimizer state starts fresh.", stacklevel=2)


def consolidate(path: Path, out_directory: Optional[Path] = None) -> Path:
    """One plain checkpoint folder (``state.pt`` with a clean model state dict and the extra state) from
    a sharded one, in one process, without a process group. Never replaces an existing checkpoint and
    never writes into the source."""
    path = Path(path)
    manifest = verify(path)
    if not manifest.get("sharded"):
        raise CheckpointError(f"{path} is not a sharded (DCP) checkpoint.", "it already is a single state.pt.")
    step = manifest.get("step")
    if not isinstance(step, int):
        raise CheckpointError(f"the manifest of {path} has no step number.", "the checkpoint is corrupt.")
    target = Path(out_directory) if out_directory else path.parent / "consolidated"
    if target.is_symlink():
        raise CheckpointError(f"{target} is a symbolic link.", "give --out a real folder.")
    source, out = path.resolve(), target.resolve()
    if out == source or source in out.parents:
        raise CheckpointError(f"--out {target} is inside the checkpoint being consolidated.",
                              "write the consolidated checkpoint to another folder.")
    if (target / step_name(step)).exists():
        raise CheckpointError(f"{target / step_name(step)} already exists.",
                              "choose another --out; an existing checkpoint is never replaced.")
    try:
        model_state = _read_model_tensors(path, manifest)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        from multigpu.checkpoint.dcp_safe import last_line

        raise CheckpointError(f"cannot read the shards of {path}: {last_line(exc)}",
                              "the checkpoint is corrupt; use an earlier one.") from None
    if not model_state:
        raise CheckpointError(f"{path} holds no model state.", "it was not written by multigpu.")
    extra = load_state(path / EXTRA_FILE)
    state = {"model": model_state, **{k: v for k, v in extra.items() if k not in ("rng", "ranks")}}

    def fill(tmp: Path) -> dict:
        torch.save(state, tmp / STATE_FILE)
        return {}

    return write_checkpoint_folder(target, step, fill, meta={"consolidated_from": str(path)}, overwrite=False)


def _read_model_tensors(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The model's full tensors from a DCP folder, with plain names, without a model to load into:
    empty tensors of the sizes the (safely read) metadata gives, filled by DCP in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from multigpu.checkpoint.dcp_safe import SafeLoadPlanner, SafeReader, read_checked_metadata

    metadata = read_checked_metadata(path, manifest)
    paths = getattr(metadata, "planner_data", None) or {}
    target, names = {}, {}
    for fqn, entry in metadata.state_dict_metadata.items():
        where = paths.get(fqn) if isinstance(paths, dict) else None
        if isinstance(entry, TensorStorageMetadata) and isinstance(where, tuple) and where[:1] == ("model",):
            target[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
            names[fqn] = ".".join(str(p) for p in where[1:])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=SafeReader(path, metadata), planner=SafeLoadPlanner(), no_dist=True)
    return {names[fqn]: tensor for fqn, tensor in target.items()}
