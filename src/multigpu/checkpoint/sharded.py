"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank writes its shards,
and a checkpoint saved by N ranks loads on M ranks (or into a plain model in one process).

Why DCP: it stores each tensor with its global shape and the slices each file holds, so loading
reshards to whatever layout the target model has - FSDP on 3 ranks, or ordinary tensors - without
anyone gathering the whole model in one process. The folder is made atomic the same way as every
other checkpoint (temporary name, manifest with sizes and CRC-32, rename), by rank 0 after all ranks
finished writing. ``consolidate`` turns one into a single plain ``state.pt``.
"""

from __future__ import annotations

import contextlib
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from multigpu.checkpoint.files import (
    STATE_FILE,
    Draft,
    finalize,
    load_state,
    read_manifest,
    start_draft,
    verify,
    write_checkpoint_folder,
)
from multigpu.checkpoint.place import CHECKSUM, HashingWriter, Place, step_name
from multigpu.errors import CheckpointError, visible

if TYPE_CHECKING:
    from multigpu.checkpoint.background import PendingSave

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


def writer(path: Path, threads: int = 2) -> Any:
    """DCP's file writer into ``path`` (a draft folder the door created and checked), every file hashed
    while DCP writes it: ``writer.fs.digests`` holds ``{name: (size, digest)}`` afterwards.

    ``threads``: two writing threads (DCP's default is one) took 0.69x of the time of DCP's default save
    of CPU tensors (docs/benchmarks.md). From GPU memory DCP copies with an overlapping loader only when
    it writes with one thread, and we have not measured which is faster there: GPU tensors keep one."""
    from torch.distributed.checkpoint import FileSystemWriter

    storage = FileSystemWriter(str(path), sync_files=True, thread_count=threads)
    storage.fs = _hashing_file_system()
    return storage


def _hashing_file_system() -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        """DCP's FileSystem whose write streams hash what goes through them (the manifest's checksums
        without reading the shards back)."""

        def __init__(self) -> None:
            super().__init__()
            self.digests: dict[str, tuple[int, str]] = {}

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                with ThreadPoolExecutor(max_workers=1, thread_name_prefix="multigpu-hash") as pool:
                    hashed = HashingWriter(stream, pool)  # type: ignore[arg-type]  # torch types it IOBase: a binary file
                    yield _Stream(hashed, stream)
            # DCP writes ".metadata.tmp" and renames it to ".metadata" (its own rename)
            name = Path(path).name
            self.digests[name[: -len(".tmp")] if name.endswith(".metadata.tmp") else name] = (
                hashed.hasher.size,
                hashed.hasher.digest(),
            )

    return HashingFileSystem()


class _Stream:
    """The stream DCP writes into: writes go through the hashing writer, everything else (tell, fileno for
    its fsync, close) is the file's."""

    def __init__(self, hashed: HashingWriter, stream: Any) -> None:
        self._hashed, self._stream = hashed, stream

    def write(self, data: Any) -> int:
        return self._hashed.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _record(draft: Draft, digests: dict[str, tuple[int, str]]) -> None:
    for name, (size, digest) in digests.items():
        if name.endswith(".distcp") or name == METADATA:
            draft.record(name, size, CHECKSUM, digest)


def save(
    directory: Path,
    step: int,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    extra: dict[str, Any],
    *,
    is_main: bool,
    barrier: Callable[[], None],
    meta: Optional[dict[str, Any]] = None,
    gather: Optional[Callable[[Any], Optional[list[Any]]]] = None,
) -> Path:
    """Every rank calls this. Shards go through DCP; ``extra`` (counters, RNG, scheduler) is written by rank 0.
    ``gather``: collects each rank's checksums on rank 0 (None in a single process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(
        model, [optimizer] if optimizer is not None else [], options=_options(True)
    )
    if is_main:
        start_draft(directory, step, unique=False)  # the same name on every rank, without talking
    barrier()
    draft = Draft.sharded(directory, step)
    on_cpu = all(t.device.type == "cpu" for t in model.parameters())
    storage = writer(draft.path, threads=2 if on_cpu else 1)
    with warnings.catch_warnings():  # a world of one saves "in a single process": what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_state, "optimizer": optim_state}, storage_writer=storage)
    everyone = gather(storage.fs.digests) if gather is not None else [storage.fs.digests]
    final = Path(directory) / step_name(step)
    if is_main:
        for digests in everyone or []:
            _record(draft, digests)
        draft.save(EXTRA_FILE, extra)
        final = finalize(draft, step, meta={**(meta or {}), "sharded": True, FLAT_OPTIMIZER: True})
    barrier()
    return final


def load(
    path: Path,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    map_location: Any = "cpu",
    manifest: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Load shards into ``model``/``optimizer`` whatever their layout now; return the extra state.

    The metadata and non-tensor entries are read by :mod:`multigpu.checkpoint.dcp_safe`: a planted
    object is refused, not run.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from multigpu.checkpoint.dcp_safe import (
        SafeLoadPlanner,
        SafeReader,
        last_line,
        read_checked_metadata,
    )

    manifest = manifest if manifest is not None else read_manifest(Path(path))
    # before DCP sees the folder: a planted object stops here
    metadata = read_checked_metadata(path, manifest)
    optimizers = [optimizer] if optimizer is not None else []
    options = _options(bool(manifest.get(FLAT_OPTIMIZER)))
    model_state, optim_state = get_state_dict(model, optimizers, options=options)
    # DCP's STATE_DICT_TYPE, loaded in place
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
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
        raise CheckpointError(
            f"cannot load the sharded checkpoint {visible(str(path))}: {visible(last_line(exc))}",
            "it was saved from a different model; resume with the same model configuration.",
        ) from None
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options,
    )
    return load_state(Path(path) / EXTRA_FILE, map_location=map_location)


def load_full_into_sharded(model: nn.Module, full_model_state: dict[str, Any]) -> None:
    """A replicated checkpoint (one ``state.pt``) into a sharded model: every rank keeps its slice."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, full_model_state, options=StateDictOptions(full_state_dict=True))
    warnings.warn(
        "multigpu: loaded model weights from a replicated checkpoint into a sharded model; "
        "the optimizer state starts fresh.",
        stacklevel=2,
    )


def consolidate(path: Path, out_directory: Optional[Path] = None) -> Path:
    """One plain checkpoint folder (``state.pt`` with a clean model state dict and the extra state) from
    a sharded one, in one process, without a process group. Never replaces an existing checkpoint and
    never writes into the source."""
    path = Path(path)
    manifest = verify(path)  # reads only: nothing of the source is moved, fixed or deleted
    if not manifest.get("sharded"):
        raise CheckpointError(
            f"{visible(str(path))} is not a sharded (DCP) checkpoint.",
            "it already is a single state.pt.",
        )
    step = manifest.get("step")
    if not isinstance(step, int):
        raise CheckpointError(
            f"the manifest of {visible(str(path))} has no step number.",
            "the checkpoint is corrupt.",
        )
    target = Path(out_directory) if out_directory else path.parent / "consolidated"
    place = Place.of(target)
    source, out = path.resolve(), target.resolve()
    if out == source or source in out.parents:
        raise CheckpointError(
            f"--out {visible(str(target))} is inside the checkpoint being consolidated.",
            "write the consolidated checkpoint to another folder.",
        )
    if place.require(create=False) and place.root.kind(place.sub(step_name(step))) is not None:
        raise CheckpointError(
            f"{visible(str(target / step_name(step)))} already exists.",
            "choose another --out; an existing checkpoint is never replaced.",
        )
    try:
        model_state = _read_model_tensors(path, manifest)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        from multigpu.checkpoint.dcp_safe import last_line

        raise CheckpointError(
            f"cannot read the shards of {visible(str(path))}: {visible(last_line(exc))}",
            "the checkpoint is corrupt; use an earlier one.",
        ) from None
    if not model_state:
        raise CheckpointError(
            f"{visible(str(path))} holds no model state.", "it was not written by multigpu."
        )
    extra = load_state(path / EXTRA_FILE)
    state = {"model": model_state, **{k: v for k, v in extra.items() if k not in ("rng", "ranks")}}

    return write_checkpoint_folder(
        target,
        step,
        lambda draft: draft.save(STATE_FILE, state),
        meta={"consolidated_from": str(path)},
        overwrite=False,
    )


def _read_model_tensors(path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
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
        if (
            isinstance(entry, TensorStorageMetadata)
            and isinstance(where, tuple)
            and where[:1] == ("model",)
        ):
            target[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
            names[fqn] = ".".join(str(p) for p in where[1:])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            target,
            storage_reader=SafeReader(path, metadata),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    return {names[fqn]: tensor for fqn, tensor in target.items()}


def start_save(
    directory: Path,
    step: int,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    extra: dict[str, Any],
    *,
    is_main: bool,
    barrier: Callable[[], None],
    meta: Optional[dict[str, Any]],
    stager: Any,
    group: Any,
    after: Callable[[], None],
) -> PendingSave:
    """Every rank calls this: DCP's ``async_save`` stages the shards to CPU memory and writes them on a
    thread (its collectives on ``group``, a gloo group of its own, never the training's); rank 0 then
    writes ``extra``, the manifest, renames the folder into place and runs ``after``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from multigpu.checkpoint.background import PendingSave

    model_state, optim_state = get_state_dict(
        model, [optimizer] if optimizer is not None else [], options=_options(True)
    )
    if is_main:
        start_draft(directory, step, unique=False)
    barrier()
    draft = Draft.sharded(directory, step)
    storage = writer(draft.path)  # async_save writes from its CPU copy, whatever the device
    staged_extra = stager.stage(extra) if is_main else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        future = dcp.async_save(
            {"model": model_state, "optimizer": optim_state},
            storage_writer=storage,
            process_group=group,
        )
    # an AsyncSaveResponse comes only with an async_stager, never given here
    if not isinstance(future, Future):
        raise TypeError(f"dcp.async_save returned a {type(future).__name__}, not a Future")

    def finish() -> None:
        # every rank's shards and the global .metadata are written (DCP's own barrier)
        future.result()
        if is_main:
            # the other ranks' shards are summed by finalize, reading them
            _record(draft, storage.fs.digests)
            draft.save(EXTRA_FILE, staged_extra)
            finalize(draft, step, meta={**(meta or {}), "sharded": True, FLAT_OPTIMIZER: True})
            after()

    return PendingSave(Path(directory) / step_name(step), finish)
