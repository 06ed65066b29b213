"""The Trainer in a job of replica groups (``multigpu run --replica-groups R``, strategy ``ft-ddp``).

Why a module apart from the loop: the loop stays the same loop; what differs when a group can die and
come back is said here, in one place. The loop calls it at five points - which checkpoint to resume,
join before the first batch, after each optimizer step, the end of fit, and where the files go - always:
without replica groups :class:`NoReplicas` answers as the loop did before.

The semantics (docs/fault-tolerance.md):

- **Step counter**: the quorum's committed steps. A step that does not commit (a group died during it) is
  dropped with its batch: no optimizer step, no scheduler step, the counter does not move. Every live
  group holds the same counter, weights and optimizer state after every committed step.
- **Data**: group g, rank r reads shard ``g x P + r`` of ``R x P`` (fixed). While a group is gone its
  shard is skipped, not redistributed: the global batch shrinks to ``batch x P x live groups`` (a line
  says so when the count of live groups changes).
- **Coming back**: a restarted group loads the newest checkpoint of any group, then heals from a live
  peer at the first quorum - weights, optimizer, scheduler, scaler, best-metric tracker and the counters
  (epoch, batch, step) - and continues at the same step as the others, at the same place in the data.
  torchft's own counters (``Manager.state_dict()``) are saved in every checkpoint with the optimizer's
  state (ft-ddp's optimizer holds them) and loaded with it; its step is the Trainer's step.
- **Files**: each group writes its own ``out_dir/replica-group-<g>/`` (checkpoints, logs, metrics); the
  checkpoints of every group hold the same training, so a resume takes the newest of them all.
- **Finished**: the first group to finish writes ``out_dir/replica-groups-finished.json``. A group that
  finds itself alone in a quorum while that file names a later step than its own (it was restarted just
  as the others finished) stops instead of training the job again on its own.
- **Validation**: each group evaluates every validation sample with the same weights, so ``valid_*``
  metrics are the same in every group; ``train_*`` metrics are each group's own share of the data.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import torch.distributed as dist

from multigpu.checkpoint import files
from multigpu.errors import DesyncError, MultiGPUError
from multigpu.fileio import Folder
from multigpu.guards import consistency
from multigpu.trainer import resume

if TYPE_CHECKING:
    from multigpu.trainer.loop import Trainer

#: Where the first group to finish says so (in the Trainer's out_dir, shared by every group).
FINISHED_FILE = "replica-groups-finished.json"
#: At a fresh start, how long the first quorum waits for every group (they start at slightly different times).
EVERYONE_WITHIN_S = 60.0


def group_folder(out_dir: Path, group: int) -> Path:
    """A group's own folder inside the Trainer's out_dir."""
    return out_dir / f"replica-group-{group}"


class FinishedElsewhere(SystemExit):
    """This group was restarted after the job had finished in another group: leave (status 0) without
    training or saving - its own state is behind the finished one."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


def attach(trainer: "Trainer", out_dir: Path) -> tuple[Union["ReplicaGroups", "NoReplicas"], Path]:
    """The Trainer's replica-group side and its own folder: each group writes in ``out_dir/replica-group-<g>``."""
    if not getattr(trainer.strategy, "fault_tolerant", False):
        return NoReplicas(trainer), out_dir
    replicas = ReplicaGroups(trainer, out_dir)
    return replicas, replicas.folder


class NoReplicas:
    """A job without replica groups: each point of the loop does what it did before."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    def latest(self, checksums: bool) -> Optional[files.CheckpointInfo]:
        return self.trainer.run.latest_checkpoint(self.trainer.checkpoint_dir, checksums=checksums)

    def join(self, epochs: int) -> tuple[int, int]:
        return self.trainer.state.epoch, self.trainer.state.batch_in_epoch

    def after_step(self, stepped: bool) -> None:
        """Nothing to do."""

    def finished(self) -> None:
        """Nothing to do."""


class ReplicaGroups:
    """One Trainer's side of the replica groups (see the module docstring)."""

    def __init__(self, trainer: "Trainer", out_dir: Path) -> None:
        from multigpu.strategies.fault_tolerant import FaultTolerantDDP

        self.trainer = trainer
        if not isinstance(trainer.strategy, FaultTolerantDDP):  # attach: only it is fault_tolerant
            raise MultiGPUError(
                f"replica groups need strategy ft-ddp, not {trainer.strategy.name!r}."
            )
        self.strategy = trainer.strategy
        world = trainer.run.world
        self.group, self.groups = world.replica_group, world.replica_groups
        #: The Trainer's out_dir as configured (shared by every group); each writes its own folder in it.
        self.root = out_dir
        self._joining = False
        self._participants: Optional[int] = None
        self._fingerprint = {
            **consistency.model_fingerprint(trainer.state_model),
            **consistency.config_items("trainer", trainer.settings.plain()),
            **consistency.config_items("config", consistency.plain(trainer.config)),
            **consistency.environment_fingerprint(),
        }
        self.strategy.register_state("trainer", self._load, self._state, first=True)

    @property
    def folder(self) -> Path:
        return group_folder(self.root, self.group)

    # ------------------------------------------------------------------ checkpoints
    def latest(self, checksums: bool) -> Optional[files.CheckpointInfo]:
        """The newest checkpoint that verifies in any group's folder (ties: this group's own). Chosen by
        this group's rank 0, the same on every rank of the group. Other groups' folders are only read:
        a save interrupted there is theirs to repair."""
        run = self.trainer.run
        found: Optional[files.CheckpointInfo] = None
        if run.is_main:
            # its own first: ties stay home
            for group in sorted(range(self.groups), key=lambda g: g != self.group):
                directory = group_folder(self.root, group) / "checkpoints"
                info = (
                    files.latest(directory, checksums=checksums, report=run.print)
                    if group == self.group
                    else _newest_readonly(directory, checksums)
                )
                if info is not None and (found is None or info.step > found.step):
                    found = info
        if not run.world.is_distributed:
            return found
        box = [None if found is None else (str(found.path), found.step, found.meta)]
        dist.broadcast_object_list(box, src=0, group=run.control_group)
        return (
            None if box[0] is None else files.CheckpointInfo(Path(box[0][0]), box[0][1], box[0][2])
        )

    # ------------------------------------------------------------------ the loop's four points
    def join(self, epochs: int) -> tuple[int, int]:
        """The first quorum, before the first batch: heal from a live peer if the others are ahead. Returns
        where in the data to start (the epoch and batch of the step the live groups are at)."""
        t = self.trainer
        if t.state.epoch >= epochs or (
            t.settings.max_steps is not None and t.state.global_step >= t.settings.max_steps
        ):
            # nothing left to train (the job had finished): no quorum
            return t.state.epoch, t.state.batch_in_epoch
        # resumed from a checkpoint written without ft-ddp
        if self.strategy.committed_step() != t.state.global_step:
            self.strategy.load_manager_state({"step": t.state.global_step})
        self._joining = True
        try:
            self.strategy.join(EVERYONE_WITHIN_S)
        finally:
            self._joining = False
        self._participants = self.strategy.participants()
        if self._participants < self.groups:
            t.run.print(
                f"multigpu: replica group {self.group}: starting at step {t.state.global_step} with "
                f"{self._describe(self._participants)}"
            )
            self._stop_if_finished_elsewhere(t.state.global_step)
        return t.state.epoch, t.state.batch_in_epoch

    def after_step(self, stepped: bool) -> None:
        """After the optimizer step (before logging and checkpoints): the quorum's count of live groups."""
        t = self.trainer
        if not stepped:
            t.run.print(
                f"multigpu: replica group {self.group}: step {t.state.global_step + 1} was not committed by "
                "every live group (one failed during it); its batch is dropped"
            )
        participants = self.strategy.participants()
        if participants != self._participants:
            self._participants = participants
            t.run.print(f"multigpu: step {t.state.global_step}: {self._describe(participants)}")
            if participants < self.groups:
                self._stop_if_finished_elsewhere(t.state.global_step - int(stepped))

    def finished(self) -> None:
        """The end of fit: say that the job is done, for a group restarted too late to know."""
        t = self.trainer
        if t.run.is_main:
            record = {"step": t.state.global_step, "epoch": t.state.epoch, "group": self.group}
            Folder(self.root).write_atomic(FINISHED_FILE, json.dumps(record))

    # ------------------------------------------------------------------ heal: what travels between groups
    def _state(self) -> dict[str, Any]:
        """Sent to a group that heals. Called in torchft's quorum thread while this process waits for the
        quorum in the forward pre-hook, so nothing here changes meanwhile."""
        t = self.trainer
        return {
            "trainer": dataclasses.asdict(t.state),
            "scheduler": t.scheduler.state_dict() if t.scheduler is not None else None,
            "scaler": t.precision.state_dict(),
            "monitor": t.tracker.state_dict() if t.tracker is not None else None,
            "fingerprint": dict(self._fingerprint),
        }

    def _load(self, state: Mapping[str, Any]) -> None:
        """Received from a live peer (before this step's forward): the same counters, schedules and data
        position as the others. Inside the loop the data position must already be the peer's."""
        t = self.trainer
        differences = consistency.compare([state.get("fingerprint") or {}, self._fingerprint])
        if differences:
            shown = (
                "; ".join(differences)
                .replace("rank 0 =", "live group =")
                .replace("rank 1 =", "this group =")
            )
            raise DesyncError(
                f"replica group {self.group} differs from the live group it heals from "
                f"({len(differences)} difference(s)): {shown}",
                "start every replica group with the same code, config and package versions.",
            )
        counters = resume.checked_counters(state.get("trainer"))
        if not self._joining and (counters.epoch, counters.batch_in_epoch) != (
            t.state.epoch,
            t.state.batch_in_epoch,
        ):
            raise MultiGPUError(
                f"replica group {self.group} fell out of step: it is at epoch {t.state.epoch} batch "
                f"{t.state.batch_in_epoch}, the live groups at epoch {counters.epoch} batch "
                f"{counters.batch_in_epoch}.",
                "its agent restarts it (--max-restarts) and it heals "
                "before its first batch; this is a bug if it repeats.",
            )
        behind = counters.global_step - t.state.global_step
        t.state = counters
        if t.scheduler is not None and state.get("scheduler") is not None:
            t.scheduler.load_state_dict(state["scheduler"])
        t.precision.load_state_dict(state.get("scaler") or {})
        if t.tracker is not None and isinstance(state.get("monitor"), Mapping):
            t.tracker.load_state_dict(state["monitor"])
        if behind:
            t.run.print(
                f"multigpu: replica group {self.group} healed from a live peer: now at step {counters.global_step} "
                f"(epoch {counters.epoch + 1}, batch {counters.batch_in_epoch}), {behind} step(s) ahead of "
                "where it resumed"
            )

    # ------------------------------------------------------------------ helpers
    def _describe(self, participants: int) -> str:
        batch = self.trainer.settings.batch_size * self.trainer.run.degrees.dp_size
        return (
            f"{participants} of {self.groups} replica group(s) live, global batch {batch * participants} "
            f"of {batch * self.groups}"
        )

    def _stop_if_finished_elsewhere(self, step: int) -> None:
        done = self._finished_step()
        if done is not None and done > step:
            message = (
                f"multigpu: replica group {self.group} stops: the job already finished at step {done} in "
                f"another replica group (this group was at step {step}); its checkpoint is the result"
            )
            self.trainer.run.print(message)
            raise FinishedElsewhere(message)

    def _finished_step(self) -> Optional[int]:
        try:
            record = json.loads(Folder(self.root).load_text(FINISHED_FILE, limit=4096))
        except (OSError, ValueError, RecursionError):
            return None
        step = record.get("step") if isinstance(record, dict) else None
        return step if isinstance(step, int) and not isinstance(step, bool) else None


def _newest_readonly(directory: Path, checksums: bool) -> Optional[files.CheckpointInfo]:
    """The newest checkpoint in another group's folder that verifies; nothing is moved or repaired."""
    for info in files.list_checkpoints(directory):
        try:
            return files.CheckpointInfo(info.path, info.step, files.verify(info.path, checksums))
        except MultiGPUError:
            continue
    return None
