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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from multigpu.checkpoint import files
from multigpu.errors import ConfigError, visible
from multigpu.fileio import Folder

#: The folders the Trainer keeps in a run's folder: each a real folder (or absent), never a link or a file.
OWNED = ("checkpoints", "checkpoints/best", "hang", "tensorboard", "wandb", "mlruns", "logs", "profile")
#: The manifest key the layout is written under.
LAYOUT_KEY = "layout"
#: Sibling folders looked at (``out_dir-2`` ... ``out_dir-N``): a parent folder of thousands is not listed.
MAX_SIBLINGS = 1000
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
    groups = {id(p): index for index, group in enumerate(getattr(optimizer, "param_groups", [])) for p in group["params"]}
    entries = sorted((name, tuple(int(d) for d in p.shape), groups.get(id(p), -1)) for name, p in model.named_parameters())
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
    counts = [c for c in (tensors, parameters) if isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 10**15]
    return Layout(digest, tensors, parameters) if len(counts) == 2 else None  # type: ignore[arg-type]


def siblings(base: Path) -> list[Path]:
    """``base`` and its numbered siblings that exist, in order: ``base``, ``base-2``, ``base-3``, ..."""
    pattern = re.compile(re.escape(base.name) + r"-([2-9]|[1-9][0-9]{1,5})")
    numbered: list[tuple[int, Path]] = []
    try:
        entries = base.parent.iterdir() if base.parent.is_dir() else iter(())
        for index, entry in enumerate(entries):
            if index >= MAX_SIBLINGS * 10:
                break
            match = pattern.fullmatch(entry.name)
            if match and len(numbered) < MAX_SIBLINGS and entry.is_dir() and not entry.is_symlink():  # never a link
                numbered.append((int(match.group(1)), entry))
    except OSError:
        pass
    return [base] + [path for _, path in sorted(numbered)]


def newest_layout(out_dir: Path) -> tuple[bool, Optional[Layout]]:
    """(whether ``out_dir`` holds a checkpoint, the layout its newest one names). Reads only."""
    try:
        info = files.latest(out_dir / "checkpoints", checksums=False, report=lambda _message: None)
    except (OSError, ValueError, ConfigError):
        return False, None
    return (info is not None), (saved_layout(info.meta) if info is not None else None)


def place(base: Path, mine: Layout, fresh: bool = False, in_queue: bool = False,
          look: Callable[[Path], tuple[bool, Optional[Layout]]] = newest_layout) -> tuple[Path, Optional[str]]:
    """The folder this run writes in, and the line that says why it is not ``base`` (None when it is).

    The first of ``base``, ``base-2``, ... whose newest checkpoint is of this layout (or names none: a
    checkpoint from before layouts resumes as before); else the first that holds no checkpoint, or the
    next number. ``fresh``: always a folder without checkpoints. Under the queue a run's folder is the
    queue's to name: another model there is an error, not a sibling the queue would not know."""
    taken: list[tuple[Path, Optional[Layout]]] = []
    free: Optional[Path] = None
    for folder in siblings(base):
        holds, saved = look(folder)
        if not holds:
            free = free or folder
        elif not fresh and (saved is None or saved.digest == mine.digest):
            return folder, (None if folder == base else f"multigpu: continuing the run of this model in "
                            f"{visible(str(folder))} ({visible(str(base))} holds a run of another model)")
        else:
            taken.append((folder, saved))
    if free is None:  # the next number whose name nothing holds yet (a planted link or file is skipped)
        last = siblings(base)[-1]
        number = int(last.name.rsplit("-", 1)[1]) + 1 if last != base else 2
        while base.with_name(f"{base.name}-{number}").is_symlink() or base.with_name(f"{base.name}-{number}").exists():
            number += 1
        free = base.with_name(f"{base.name}-{number}")
    if free == base:
        return base, None
    why = "trainer.fresh is set" if fresh else _difference(base, taken[0][1], mine)
    if in_queue:
        raise ConfigError(f"{visible(str(base))} holds a run of another model ({why}).",
                          "give this run a new name in the runs file, or remove its folder to train it afresh.")
    return free, f"multigpu: a new run in {visible(str(free))}: {why}"


def _difference(base: Path, saved: Optional[Layout], mine: Layout) -> str:
    theirs = saved.describe() if saved is not None else "another layout"
    return f"{visible(str(base))} holds a run of another model or optimizer ({theirs}; this one: {mine.describe()})"


def explicit(path: str) -> files.CheckpointInfo:
    """``trainer.resume_from``: a ``step-N`` checkpoint, or a folder of them (a run's ``checkpoints`` or
    the run folder itself; its newest good one). Verified before anything is read."""
    given = Path(path)
    candidates: Iterable[Path] = (given / "checkpoints", given) if not files.is_checkpoint(given) else ()
    for folder in candidates:
        info = files.latest(folder, checksums=True, report=lambda _message: None)
        if info is not None:
            return info
    if files.is_checkpoint(given):
        manifest = files.verify(given)
        step = manifest.get("step")
        return files.CheckpointInfo(given, step if isinstance(step, int) and not isinstance(step, bool) else 0, manifest)
    raise ConfigError(f"trainer.resume_from {visible(path)[:200]} holds no checkpoint.",
                      "name a run folder, its checkpoints folder or one step-N folder in it.")


def settle(run: Any, model: nn.Module, optimizer: Any, out_dir: str, fresh: bool,
           resume_from: Optional[str] = None) -> tuple[Layout, Path]:
    """The Trainer's layout and folder, the same on every rank: rank 0 looks at the folders (one answer,
    even while another rank's files appear), the others wait for it; the line is printed once."""
    base = run.check_writable(out_dir, "the Trainer's out_dir")
    if resume_from is not None and not Path(resume_from).exists():
        raise ConfigError(f"trainer.resume_from {visible(resume_from)[:200]} does not exist.",
                          "name a run folder, its checkpoints folder or one step-N folder in it.")

    def gather(value: Any) -> list[Any]:
        if run.world_size == 1 or not torch.distributed.is_initialized():
            return [value]
        parts: list[Any] = [None] * run.world_size
        torch.distributed.all_gather_object(parts, value, group=run.control_group)
        return parts

    mine = layout_of(model, optimizer, gather)
    folder, line = run.run_on_main(lambda: place(base, mine, fresh, in_queue=run.world.run_dir is not None))
    if line:
        run.print(line)
    checked = run.check_writable(folder, "the Trainer's out_dir")
    return mine, checked


def check_owned(out_dir: Path) -> None:
    """Refuse a run folder where one of the Trainer's folders is a link or a file: never written through."""
    if not Folder(out_dir).only_folders_at(OWNED):
        raise ConfigError(f"{visible(str(out_dir))} holds a link or a file where the Trainer keeps one of "
                          f"its folders ({', '.join(OWNED)}).",
                          "remove it (or choose another out_dir): the Trainer never writes through a link.")
