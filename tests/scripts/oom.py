"""Fail as CUDA does when memory runs out (the type and message torch raises), without needing a GPU;
wrapped in another exception, as torch.compile's errors wrap the one that caused them."""

import torch

try:
    raise torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"
    )
except torch.cuda.OutOfMemoryError as exc:
    raise RuntimeError("backend compiler failed") from exc
