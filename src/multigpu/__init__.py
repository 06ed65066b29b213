"""multigpu: one PyTorch training script on one GPU, every GPU, several machines, Slurm or a GPU pool.

The public API, in the order a script uses it::

    import multigpu as mg
    run = mg.init()                                   # world found, process group started
    mg.run_on_main(prepare_data, root)                # once, on rank 0; the others wait
"""

from multigpu.errors import MultiGPUError
from multigpu.helpers import (
    get_logger,
    is_main,
    rank_zero_only,
    rank_zero_print,
    run_on_main,
)
from multigpu.data import Loader
from multigpu.metrics import MetricSums
from multigpu.runtime import Run, init
from multigpu.stages import Stages
from multigpu.trainer import Trainer, TrainerSettings
from multigpu.world import World, detect_world

__version__ = "0.1.0"

__all__ = [
    "Loader",
    "MetricSums",
    "MultiGPUError",
    "Trainer",
    "TrainerSettings",
    "Run",
    "Stages",
    "World",
    "detect_world",
    "get_logger",
    "init",
    "is_main",
    "rank_zero_only",
    "rank_zero_print",
    "run_on_main",
]
