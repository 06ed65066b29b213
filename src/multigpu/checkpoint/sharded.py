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

from multigpu.checkpoint.files import (
    STATE_FILE,
    finalize_folder,
    load_state,
    step_name,
    temporary_folder,
    write_checkpoint_folder,
)
from multigpu.errors import CheckpointError

EXTRA_FILE = "extra.pt"
METADATA = ".metadata"


def is_sharded(path: Path) -> bool:
    return (Path(path) / METADATA).exists()


def save(directory: Path, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], extra: dict,
         *, is_main: bool, barrier: Callable[[], None], meta: Optional[dict] = None) -> Path:
    """Every rank calls this. Shards go through DCP; ``extra`` (counters, RNG, scheduler) is written by rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, [optimizer] if optimizer is not None else [])
    tmp = Path(directory) / f".tmp-{step_name(step)}-sharded"  # the same on every rank, without talking
    if is_main:
        temporary_folder(directory, step, unique=False)
    barrier()
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
    if is_main:
        torch.save(extra, tmp / EXTRA_FILE)
    barrier()
    final = Path(directory) / step_name(step)
    if is_main:
        final = finalize_folder(tmp, step, meta={**(meta or {}), "sharded": True})
    barrier()
    return final


def load(path: Path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
         map_location: Any = "cpu") -> dict:
    """Load shards into ``model``/``optimizer`` whatever their layout now; return the extra state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    optimizers = [optimizer] if optimizer is not None else []
    model_state, optim_state = get_state_dict(model, optimizers)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        with warnings.catch_warnings():  # "loading in a single process" is what we mean to do
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:
        raise CheckpointError(f"cannot load the sharded checkpoint {path}: {' '.join(str(exc).split())[:300]}",
                              "it was saved from a different model; resume with the same model configuration.") from None
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return load_state(Path(path) / EXTRA_FILE, map_location=map_location)


def load_full_into_sharded(model: nn.Module, full_model_state: dict) -> None:
    """A replicated checkpoint (one ``state.pt``) into a sharded model: every rank keeps its slice."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, full_model_state, options=StateDictOptions(full_state_dict=True))
    warnings.warn("multigpu: loaded model weights from a replicated checkpoint into a sharded model; "
                  "the optimizer state starts fresh.", stacklevel=2)


def consolidate(path: Path, out_directory: Optional[Path] = None, step: Optional[int] = None) -> Path:
    """One plain checkpoint folder (``state.pt`` with a clean model state dict and the extra state) from
    a sharded one, in one process, without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    if not is_sharded(path):
        raise CheckpointError(f"{path} is not a sharded (DCP) checkpoint.", "it already is a single state.pt.")
    target = Path(out_directory) if out_directory else path.parent / "consolidated"
    tmp_file = target / f".dcp-{path.name}.pt"
    target.mkdir(parents=True, exist_ok=True)
    try:
        dcp_to_torch_save(str(path), str(tmp_file))
        full = torch.load(tmp_file, weights_only=True)
    finally:
        tmp_file.unlink(missing_ok=True)
    extra = load_state(path / EXTRA_FILE)
    state = {"model": full["model"], **{k: v for k, v in extra.items() if k != "rng"}}
    the_step = step if step is not None else int(path.name.split("-")[-1])

    def fill(tmp: Path) -> dict:
        torch.save(state, tmp / STATE_FILE)
        return {}

    return write_checkpoint_folder(target, the_step, fill, meta={"consolidated_from": str(path)})
