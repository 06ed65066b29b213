"""A Trainer's checkpoints: what is saved, where, and how a run continues from one.

Why apart from the loop: saving and resuming are their own choreography - the state gathered from
every part (model, optimizer, scheduler, scaler, counters, data layout, the best-metric tracker, the
extras), the run's own checkpoints before one named by ``resume_from``, settings given now winning
over the saved ones with every difference said once, and a checkpoint read as data from disk (wrong
types or sizes are a CheckpointError, never a traceback). The Trainer's methods of the same names
call these, so a subclass still overrides ``checkpoint_state`` or ``load_checkpoint_state``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from multigpu.errors import CheckpointError, visible
from multigpu.guards import consistency
from multigpu.trainer import identity, resume
from multigpu.trainer.batches import move_to
from multigpu.trainer.monitor import BestTracker

if TYPE_CHECKING:
    from multigpu.trainer.loop import Trainer


def state_of(trainer: Trainer) -> dict[str, Any]:
    """:meth:`Trainer.checkpoint_state`'s default."""
    return {
        "model": trainer.state_model,
        "optimizer": trainer.optimizer,
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "scaler": trainer.precision.state_dict(),
        "trainer": dataclasses.asdict(trainer.state),
        "data": {
            "batch_size": trainer.settings.batch_size,
            "dp_size": trainer.run.dp_size,
            "world_size": trainer.run.world_size,
            "seed": trainer.settings.seed,
        },
        "settings": resume.plain_data(trainer.settings.plain()),
        "config": resume.plain_data(consistency.plain(trainer.config)),
        "monitor": trainer.tracker.state_dict() if trainer.tracker is not None else None,
        **trainer.extras.state_dict(),
    }


def save(
    trainer: Trainer,
    directory: Optional[Path] = None,
    keep_last: Optional[int] = None,
    meta: Optional[dict[str, Any]] = None,
    blocking: bool = False,
) -> Path:
    """A checkpoint of the trainer's state now (asynchronous when the settings allow and ``blocking`` is
    off); ``on_checkpoint`` once it exists."""
    # async_checkpoint: on_checkpoint once the one in flight is written
    trainer.run.wait_for_checkpoint(then=trainer.on_checkpoint)
    asynchronous = not blocking and trainer.settings.background_checkpoints(trainer.device)
    path = trainer.run.save_checkpoint(
        directory or trainer.checkpoint_dir,
        trainer.state.global_step,
        trainer.checkpoint_state(),
        keep_last=keep_last or trainer.settings.keep_last,
        asynchronous=asynchronous,
        meta={
            "epoch": trainer.state.epoch,
            identity.LAYOUT_KEY: trainer.layout.meta(),
            **(meta or {}),
        },
        rank_state=trainer.rank_state(),
    )
    if not asynchronous:
        with trainer.run.paused_watchdog():
            trainer.on_checkpoint(path)
    return path


def save_best(trainer: Trainer, tracker: BestTracker) -> Path:
    """The best checkpoint so far, in checkpoints/best (its own folder: never pruned with the others)."""
    path = save(
        trainer,
        trainer.best_dir,
        keep_last=1,
        meta={"monitor": trainer.settings.monitor, "value": tracker.best},
    )
    trainer.progress.line(
        f"multigpu: new best {trainer.settings.monitor} {tracker.best:.6g} at step "
        f"{trainer.state.global_step}: {path}"
    )
    return path


def resume_latest(trainer: Trainer) -> bool:
    """:meth:`Trainer.resume`."""
    # With replica groups: the newest of any group. This run's own checkpoints come first (a restart
    # continues), then the one resume_from names.
    info = trainer.replicas.latest(trainer.settings.verify_checksums)
    if info is None and trainer.settings.resume_from:
        info = trainer.run.run_on_main(identity.explicit, trainer.settings.resume_from)
    elif info is not None and trainer.settings.resume_from:
        trainer.run.print(
            "multigpu: trainer.resume_from not used: "
            f"{visible(str(trainer.checkpoint_dir))} holds this run's own"
        )
    if info is None:
        return False
    wanted = resume.wanted_hyperparameters(trainer.optimizer.param_groups)
    state = trainer.run.load_checkpoint(info, trainer.state_model, trainer.optimizer) or {}
    trainer.load_checkpoint_state(state)
    changes = resume.apply_hyperparameters(
        trainer.optimizer.param_groups, wanted, getattr(trainer.scheduler, "base_lrs", None)
    )
    changes += resume.changed_settings(
        {"trainer": state.get("settings"), "config": state.get("config")},
        {"trainer": trainer.settings.plain(), "config": consistency.plain(trainer.config)},
    )
    trainer.run.print(
        f"multigpu: resumed from {visible(str(info.path))} (epoch {trainer.state.epoch}, "
        f"batch {trainer.state.batch_in_epoch}, step {trainer.state.global_step})"
    )
    if changes:
        trainer.run.print(
            "multigpu: settings changed since the checkpoint (the ones given now are used): "
            + "; ".join(changes)
        )
    return True


def restore(trainer: Trainer, state: Mapping[str, Any]) -> None:
    """:meth:`Trainer.load_checkpoint_state`'s default."""
    trainer.state = resume.checked_counters(state.get("trainer"))
    data = resume.checked_data_layout(state.get("data"))
    try:
        if trainer.scheduler is not None and state.get("scheduler") is not None:
            trainer.scheduler.load_state_dict(state["scheduler"])
        trainer.precision.load_state_dict(state.get("scaler") or {})
        if trainer.tracker is not None and isinstance(state.get("monitor"), Mapping):
            trainer.tracker.load_state_dict(state["monitor"])
        trainer.extras.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CheckpointError(
            f"the checkpoint's scheduler, scaler or monitor state does not fit: "
            f"{' '.join(str(exc).split())[:200]}",
            "resume with the same settings, or start a new out_dir.",
        ) from None
    trainer.state.batch_in_epoch = resume.realigned_batches(
        trainer.state.batch_in_epoch,
        data,
        trainer.settings.batch_size * trainer.run.dp_size,
        trainer.run.print,
    )
    if state.get("rank_state") is not None:
        trainer.load_rank_state(move_to(state["rank_state"], trainer.device, non_blocking=False))
