"""Atomic, verified checkpoints: folders with a manifest, retention, the latest good one, RNG states,
and (for sharded strategies) torch.distributed.checkpoint folders that reshard on load.
"""

from multigpu.checkpoint.files import (
    CheckpointInfo,
    latest,
    list_checkpoints,
    load_state,
    prune,
    save_state,
    verify,
    write_checkpoint_folder,
)

__all__ = [
    "CheckpointInfo",
    "latest",
    "list_checkpoints",
    "load_state",
    "prune",
    "save_state",
    "verify",
    "write_checkpoint_folder",
]
