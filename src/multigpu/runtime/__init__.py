"""``mg.init()``: the one call at the top of a training script, and the :class:`Run` it returns.

``start`` finds the world and joins the others; ``run`` is the facade (``checkpoints``: its checkpoint
methods).
"""

from multigpu.runtime.run import Run as Run, rank_seed as rank_seed
from multigpu.runtime.start import allocator_fraction as allocator_fraction, init as init

__all__ = ["Run", "allocator_fraction", "init", "rank_seed"]
