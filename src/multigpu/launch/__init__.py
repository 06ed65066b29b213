"""Start processes: the local launcher on PyTorch's elastic agent, multi-node options, Slurm scripts.

The only package that chooses ports and writes MASTER_ADDR / MASTER_PORT / CUDA_VISIBLE_DEVICES for
the processes it starts. It never imports the strategies or the trainer: who starts processes is kept
apart from how a model is wrapped.
"""
