"""A run's identity: which folder a run of this model continues, so that a changed model never resumes
a checkpoint it cannot load.

Why: ``out_dir`` names a place, not a run. After ``multigpu run train.py hparams.yaml`` the quickstart's
own next example, ``... model.hidden=128``, found the first run's checkpoint in the same folder and
stopped with a size mismatch; two scripts without an hparams file shared ``outputs/`` the same way.
Hydra gives every run a new folder and Lightning a ``version_N``, but then a preempted job started again
with the same command no longer finds its checkpoint. Here a run keeps the folder it resumes from (the
same command after a crash or a preemption continues where it stopped), and a run of another model -
other parameter names or shapes, another optimizer or other parameter groups - gets the next free
sibling: ``outputs/quickstart``, ``outputs/quickstart-2``, ... (``ls`` tells them apart, and the line
printed says which and why). What a checkpoint can take - a learning rate, more epochs, another world
size or strategy (DCP reshards) - keeps the folder, and the resume prints what changed.

The layout is a digest, written into every checkpoint's manifest: old checkpoints without one resume as
before. A manifest is data from disk: what it says is compared, bounded and escaped, never trusted.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from multigpu.checkpoint import files
from multigpu.errors import CheckpointError, ConfigError, visible
from multigpu.fileio import Folder

#: The folders the Trainer keeps in a run's folder: each a real folder (or absent), never a link or a file.
OWNED = (
    "checkpoints",
    "checkpoints/best",
    "hang",
    "tensorboard",
    "wandb",
    "mlruns",
    "logs",
    "profile",
)
#: In a folder a ``fresh`` run made: the launch it was made for.
MARKER = ".multigpu-launch"
#: The manifest key the layout is written under.
LAYOUT_KEY = "layout"
#: Sibling folders looked at (``out_dir-2`` ... ``out_dir-N``), by name, and the missing numbers in a
#: row after which the look stops (a sibling deleted by hand leaves a gap).
MAX_SIBLINGS = 1000
GAP = 16
_DIGEST = re.compile(r"^[0-9a-f]{16,64}$")


@dataclass(frozen=True)
class Layout:
    """What a checkpoint must match to load: a digest of the model's parameter names and (global) shapes
    and of the optimizer's class and parameter groups, with counts to say how they differ."""

    digest: str
    tensors: int
    parameters: int

    def meta(self) -> dict[str, Any]:
        return {"digest": self.digest, "tensors": self.tensors, "parameters": self.parameters}

    def describe(self) -> str:
        return f"{self.parameters:,} parameters in {self.tensors:,} tensors"


def layout_of(model: nn.Module, optimizer: Any, gather: Callable[[Any], list[Any]]) -> Layout:
    """This run's layout: each parameter's name, global shape (DTensors under fsdp and tp say the plain
    model's) and optimizer group, and the optimizer's class. ``gather``: every rank's part - a pipeline
    stage holds only its own layers, so the parts' union is the whole model, whatever the split (a pp
    checkpoint continues in one process). Ranks holding the same part send only its digest."""
    groups = {
        id(p): index
        for index, group in enumerate(getattr(optimizer, "param_groups", []))
        for p in group["params"]
    }
    entries = sorted(
        (name, tuple(int(d) for d in p.shape), groups.get(id(p), -1))
        for name, p in model.named_parameters()
    )
    kind = type(getattr(optimizer, "optim", optimizer)).__name__
    own = _digest((entries, kind))
    if len(set(gather(own))) > 1:  # pipeline stages: the union of what they hold
        entries = sorted({entry for part in gather(entries) for entry in part})
    numel = sum(int(torch.Size(shape).numel()) for _, shape, _ in entries)
    return Layout(_digest((entries, kind)), len(entries), numel)


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:32]


def saved_layout(manifest: Any) -> Optional[Layout]:
    """The layout a checkpoint's manifest names; None when it names none (written before layouts) or
    names one we cannot read (then the resume goes on as before, and a load that does not fit says so)."""
    value = manifest.get(LAYOUT_KEY) if isinstance(manifest, dict) else None
    if not isinstance(value, dict):
        return None
    digest, tensors, parameters = value.get("digest"), value.get("tensors"), value.get("parameters")
    if not (isinstance(digest, str) and _DIGEST.match(digest)):
        return None
    counts = [
        c
        for c in (tensors, parameters)
        if isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 10**15
    ]
    return Layout(digest, tensors, parameters) if len(counts) == 2 else None  # type: ignore[arg-type]


def siblings(base: Path) -> list[Path]:
    """The numbered siblings of ``base`` that are real folders, in order: ``base-2``, ``base-3``, ...
    Looked up by name (never by listing a parent that may hold thousands of entries), until
    :data:`GAP` numbers in a row are missing; a link or a file of such a name is skipped."""
    found: list[Path] = []
    missing = 0
    for number in range(2, MAX_SIBLINGS + 2):
        folder = numbered(base, number)
        if folder.is_symlink() or not folder.exists():
            missing = missing + 1 if not folder.is_symlink() else 0
            if missing >= GAP:
                break
            continue
        missing = 0
        if folder.is_dir():
            found.append(folder)
    return found


def named(out_dir: Path) -> Path:
    """``out_dir`` with a last name to number: ``sub/..`` is ``.``, and ``.`` or ``..`` the absolute folder."""
    given = Path(os.path.normpath(out_dir))
    return given if given.name not in ("", ".", "..") else Path(os.path.abspath(given))


def numbered(base: Path, number: int) -> Path:
    return base.with_name(f"{base.name}-{number}")


def newest_layout(out_dir: Path) -> tuple[bool, Optional[Layout]]:
    """(whether ``out_dir`` holds any checkpoint folder - readable or not -, the layout its newest
    readable one names). Reads only; a folder that cannot be read counts as holding one (never free)."""
    try:
        if not files.list_checkpoints(out_dir / "checkpoints"):
            return False, None
        info = files.latest(out_dir / "checkpoints", checksums=False, report=lambda _message: None)
    except (OSError, ValueError, ConfigError, CheckpointError):
        return True, None
    return True, (saved_layout(info.meta) if info is not None else None)


def placed_by(folder: Path) -> str:
    """The launch a fresh run's folder was made for ("" for none): a restart of that launch finds it."""
    try:
        return (
            Folder(folder).load_text(MARKER, limit=256).strip()
            if Folder(folder).kind(MARKER) == "file"
            else ""
        )
    except (OSError, ValueError, UnicodeDecodeError):
        return ""


def place(
    base: Path,
    mine: Layout,
    fresh: bool = False,
    in_queue: bool = False,
    restarted: bool = False,
    look: Callable[[Path], tuple[bool, Optional[Layout]]] = newest_layout,
    launch: str = "",
) -> tuple[Path, Optional[str]]:
    """The folder this run writes in, and the line that says why it is not ``base`` (None when it is).

    ``base`` when it holds no checkpoint, or checkpoints of this layout (or of none it names: written
    before layouts, or unreadable - the resume then says what it found). Only when ``base`` holds a run
    of another model are the siblings looked at: the first whose newest checkpoint names this very
    layout continues; else the first without any checkpoint folder, or the next number. ``fresh``:
    ``base`` if it holds none, else a new sibling. Under the queue a run's folder is the queue's to name:
    another model there is an error, not a sibling the queue would not know.

    A restart of a ``fresh`` run (``--max-restarts``, a Slurm requeue) must continue the folder its first
    start made, not start yet another: ``launch`` (the launcher's id of this job) is written into that
    folder (:data:`MARKER`) and found again; where the id is not unique to the job (a static multi-node
    rendezvous), ``restarted`` takes the newest folder of this layout."""
    if fresh and (launch or restarted):
        for folder in reversed([base, *siblings(base)]):
            held, theirs = look(folder)
            if (
                placed_by(folder) == launch
                if launch
                else (held and theirs is not None and theirs.digest == mine.digest)
            ):
                return (
                    folder,
                    None
                    if folder == base
                    else f"multigpu: continuing the run of this model in {visible(str(folder))}",
                )
    holds, saved = look(base)
    if not holds or (not fresh and (saved is None or saved.digest == mine.digest)):
        return base, None
    free: Optional[Path] = None
    last = 1
    for folder in siblings(base):
        last = int(folder.name.rsplit("-", 1)[1])
        theirs_held, theirs = look(folder)
        if not theirs_held:
            free = free or folder
        elif not fresh and theirs is not None and theirs.digest == mine.digest:
            if in_queue:
                break
            return folder, (
                f"multigpu: continuing the run of this model in {visible(str(folder))} "
                f"({visible(str(base))} holds a run of another model)"
            )
    if free is None:
        number = last + 1
        while numbered(base, number).is_symlink() or numbered(base, number).exists():
            number += 1  # a planted link or file of that name is never written through
        free = numbered(base, number)
    why = "trainer.fresh is set" if fresh else _difference(base, saved, mine)
    if in_queue:
        raise ConfigError(
            f"{visible(str(base))} holds a run of another model ({why}).",
            "give this run a new name in the runs file, or remove its folder to train it afresh.",
        )
    return free, f"multigpu: a new run in {visible(str(free))}: {why}"


def _difference(base: Path, saved: Optional[Layout], mine: Layout) -> str:
    theirs = saved.describe() if saved is not None else "another layout"
    return f"{visible(str(base))} holds a run of another model or optimizer ({theirs}; this one: {mine.describe()})"


def explicit(path: str) -> files.CheckpointInfo:
    """``trainer.resume_from``: a ``step-N`` checkpoint, or a folder of them (a run's ``checkpoints`` or
    the run folder itself; its newest good one). Verified before anything is read."""
    given = Path(path)
    skipped: list[str] = []
    if files.is_checkpoint(given):
        manifest = files.verify(given)
        step = manifest.get("step")
        return files.CheckpointInfo(
            given, step if isinstance(step, int) and not isinstance(step, bool) else 0, manifest
        )
    for folder in (given / "checkpoints", given):
        if folder.is_dir() and not folder.is_symlink():
            info = files.latest(folder, checksums=True, report=skipped.append)
            if info is not None:
                return info
    why = f" ({skipped[-1][len('multigpu: ') :]})" if skipped else ""
    raise ConfigError(
        f"trainer.resume_from {visible(path)[:200]} holds no checkpoint that verifies{why[:300]}.",
        "name a run folder, its checkpoints folder or one step-N folder in it.",
    )


def settle(
    run: Any,
    model: nn.Module,
    optimizer: Any,
    out_dir: str,
    fresh: bool,
    resume_from: Optional[str] = None,
) -> tuple[Layout, Path]:
    """The Trainer's layout and folder, the same on every rank: rank 0 looks at the folders (one answer,
    even while another rank's files appear), the others wait for it; the line is printed once. A
    restart of the job (``--max-restarts``) continues where the first start was placed."""
    base = named(run.check_writable(out_dir, "the Trainer's out_dir"))
    if resume_from is not None and not Path(resume_from).exists():
        raise ConfigError(
            f"trainer.resume_from {visible(resume_from)[:200]} does not exist.",
            "name a run folder, its checkpoints folder or one step-N folder in it.",
        )

    def gather(value: Any) -> list[Any]:
        if run.world_size == 1 or not torch.distributed.is_initialized():
            return [value]
        parts: list[Any] = [None] * run.world_size
        torch.distributed.all_gather_object(parts, value, group=run.control_group)
        return parts

    mine = layout_of(model, optimizer, gather)
    launch = run.world.launch_id if run.world.launch_id not in ("", "multigpu", "none") else ""

    def chosen() -> tuple[Path, Optional[str]]:
        folder, line = place(
            base,
            mine,
            fresh,
            in_queue=run.job.run_dir is not None,
            restarted=run.world.restart_count > 0,
            launch=launch,
        )
        if fresh and launch:
            # a planted link there is replaced
            Folder(folder).create().write_atomic(MARKER, launch + "\n")
        return folder, line

    folder, line = run.run_on_main(chosen)
    if line:
        run.print(line)
    return mine, run.check_writable(folder, "the Trainer's out_dir")


def check_owned(out_dir: Path) -> None:
    """Refuse a run folder where one of the Trainer's folders is a link or a file: never written through."""
    if not Folder(out_dir).only_folders_at(OWNED):
        raise ConfigError(
            f"{visible(str(out_dir))} holds a link or a file where the Trainer keeps one of "
            f"its folders ({', '.join(OWNED)}).",
            "remove it (or choose another out_dir): the Trainer never writes through a link.",
        )
