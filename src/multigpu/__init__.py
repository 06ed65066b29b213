"""multigpu: one PyTorch training script on one GPU, every GPU, several machines, Slurm or a GPU pool.

The public API, in the order a script uses it::

    import multigpu as mg
    run = mg.init()                                   # world found, process group started
    mg.run_on_main(prepare_data, root)                # once, on rank 0; the others wait

Names are imported when first used (PEP 562), so ``import multigpu`` - and the ``multigpu`` command
for everything that does not train - does not pay for importing torch (~2 s).

A :class:`MultiGPUError` that reaches the top of a script prints as its one line with the HINT,
under plain ``python`` as under ``multigpu run`` (set ``MULTIGPU_TRACEBACK=1`` for the traceback).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from multigpu.errors import MultiGPUError

__version__ = "0.1.0"

_EXPORTS = {
    "Loader": "multigpu.data.samplers",
    "MetricSums": "multigpu.metrics",
    "Run": "multigpu.runtime",
    "init": "multigpu.runtime",
    "Stages": "multigpu.strategies.stages",
    "Trainer": "multigpu.trainer",
    "TrainerSettings": "multigpu.trainer.settings",
    "World": "multigpu.distributed.world",
    "detect_world": "multigpu.distributed.world",
    "get_logger": "multigpu.distributed.rank_zero",
    "is_main": "multigpu.distributed.rank_zero",
    "rank_zero_only": "multigpu.distributed.rank_zero",
    "rank_zero_print": "multigpu.distributed.rank_zero",
    "run_on_main": "multigpu.distributed.rank_zero",
    "write_file": "multigpu.fileio",
}

__all__ = [
    "Loader",
    "MetricSums",
    "MultiGPUError",
    "Run",
    "Stages",
    "Trainer",
    "TrainerSettings",
    "World",
    "detect_world",
    "get_logger",
    "init",
    "is_main",
    "rank_zero_only",
    "rank_zero_print",
    "run_on_main",
    "write_file",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these load on first use
    from multigpu.data.samplers import Loader
    from multigpu.distributed.rank_zero import (
        get_logger,
        is_main,
        rank_zero_only,
        rank_zero_print,
        run_on_main,
    )
    from multigpu.distributed.world import World, detect_world
    from multigpu.fileio import write_file
    from multigpu.metrics import MetricSums
    from multigpu.runtime import Run, init
    from multigpu.strategies.stages import Stages
    from multigpu.trainer import Trainer
    from multigpu.trainer.settings import TrainerSettings


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'multigpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def _one_line_errors(previous: Any) -> Any:
    def hook(kind: type, value: BaseException, tb: Any) -> None:
        if isinstance(value, MultiGPUError) and not os.environ.get("MULTIGPU_TRACEBACK"):
            print(value.one_line(), file=sys.stderr, flush=True)
            return
        previous(kind, value, tb)

    hook.multigpu = True  # type: ignore[attr-defined]
    return hook


if not getattr(sys.excepthook, "multigpu", False):
    sys.excepthook = _one_line_errors(sys.excepthook)
