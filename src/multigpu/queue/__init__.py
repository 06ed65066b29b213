"""Many runs at once: named run configs with ``child < parent`` inheritance, placed on free GPUs (or
CPU process slots) of this machine, or submitted as Slurm jobs.

Runs are subprocesses (``multigpu run`` each): this package never imports the trainer or the
strategies, so a run that crashes - or leaks memory - cannot take the queue with it.
"""
