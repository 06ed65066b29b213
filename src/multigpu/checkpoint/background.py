"""Asynchronous checkpoints: the state copied to CPU memory while training waits, written while it runs.

Why: a synchronous checkpoint stalls every rank for as long as the disk takes. Here the training loop
waits only for :class:`Stager` to copy the state's tensors into CPU buffers (pinned when they come from a
GPU, so the copy is a DMA), then a background thread writes the copy through the same atomic folder
and manifest as a synchronous save (:mod:`multigpu.checkpoint.files`). The buffers are kept for the next
save (no allocation, no page faults on the critical path) - the price is one copy of the state in host
memory, as in DCP's cached staging and torchtitan's ``async_with_pinned_mem``.

At most one save is in flight: the next save, the end of ``fit``, a preemption and ``run.close()`` wait
for it (:class:`PendingSave`). A process killed meanwhile leaves a ``.tmp-step-*`` folder that is never
read, and the previous checkpoint stays the newest good one. The thread is not a daemon: a script that
ends without waiting still finishes its last checkpoint before the interpreter exits.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch


class Stager:
    """Copies of a state's tensors in CPU memory, in buffers reused from one save to the next."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._cuda = False

    def stage(self, state: Any) -> Any:
        """The state with every tensor copied (a snapshot training may overwrite right after)."""
        self._cuda = False
        staged = self._copy(state, ())
        if self._cuda:
            torch.cuda.synchronize()  # the copies were issued non-blocking into pinned memory
        return staged

    def _copy(self, value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value.detach(), path)
        if isinstance(value, dict):
            out = {k: self._copy(v, (*path, k)) for k, v in value.items()}
            # an OrderedDict state dict keeps its type and its _metadata
            if type(value) is not dict:
                try:
                    out = type(value)(out)
                    if getattr(value, "_metadata", None) is not None:
                        out._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
                except Exception:
                    pass
            return out
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self._copy(v, (*path, i)) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        if tensor.layout != torch.strided or type(tensor) is not torch.Tensor:
            return tensor.to("cpu", copy=True)  # sparse, DTensor...: a plain copy, not cached
        key = (path, tuple(tensor.shape), tensor.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            pin = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
        cuda = tensor.device.type == "cuda"
        self._cuda = self._cuda or cuda
        buffer.copy_(tensor, non_blocking=cuda)
        return buffer

    @property
    def nbytes(self) -> int:
        """Host memory held for staging (the extra memory an asynchronous checkpoint costs)."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


class PendingSave:
    """One checkpoint being written by a background thread; :meth:`join` waits and returns its error."""

    def __init__(self, path: Path, work: Callable[[], Any]) -> None:
        self.path = path
        self.error: Optional[BaseException] = None
        self._work: Optional[Callable[[], Any]] = work  # None once done
        self._thread = threading.Thread(
            target=self._run, name=f"multigpu-checkpoint-{path.name}", daemon=False
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._work is not None:  # runs once
                self._work()
        except BaseException as exc:  # kept for the training thread, which raises it where it waits
            self.error = exc
        finally:
            self._work = None  # the staged state is released with the closure

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> Optional[BaseException]:
        self._thread.join()
        return self.error


class Finished:
    """A save with nothing left to do on this rank (other ranks of a replicated run write nothing)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.error: Optional[BaseException] = None

    def done(self) -> bool:
        return True

    def join(self) -> Optional[BaseException]:
        return None
