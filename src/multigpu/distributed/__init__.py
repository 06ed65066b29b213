"""Where this process stands and how it talks to the others.

``world``: rank, world size, node and master address, read once from torchrun, Slurm or nothing into an
immutable :class:`~multigpu.distributed.world.World` (standard library only: the command line reads it
without importing torch); ``session``: starting and closing torch.distributed (device, backend,
timeouts); ``parallel``: the parallelism degrees and the DeviceMesh; ``agreement``: every "does any
rank ...?" as one small reduction; ``rank_zero``: ``run_on_main``, rank-zero printing and logging.
"""
