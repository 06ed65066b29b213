"""Weight averaging: an exponential moving average (``ema: 0.999``) or an equal-weight average of the
weights after every optimizer step from a step on (``swa_start: N``, stochastic weight averaging).

Why its own copy of the *local* tensors: the average must cost no host synchronisation per step and no
more memory than one more copy of what this rank holds. So it keeps one tensor per parameter shaped
like this rank's part of it - the whole parameter under ddp, this rank's shard under fsdp (the shard
of a DTensor), and updates them all with one ``torch._foreach_lerp_`` after each optimizer step (the
weight is a Python number: nothing is read back from the device). The rule is torch.optim.swa_utils'
(``get_ema_multi_avg_fn`` / ``get_swa_multi_avg_fn``): the first update copies the weights, then
``avg += (1 - decay) * (w - avg)``, or ``avg += (w - avg) / (n + 1)`` for the equal-weight average.

Validation runs on the averaged weights (:meth:`WeightAverage.swapped`: copied into the model's own
tensors and back, so every strategy's forward - FSDP's all-gathers, tensor-parallel layers - works
unchanged). Checkpoints hold it as ``averaged_model``: a plain state dict with the model's names (its
buffers are the model's own), gathered to rank 0, so ``model.load_state_dict(state["averaged_model"])``
loads it into a plain model; ``averaging`` holds the counters. A resume restores it exactly, at any
world size (each rank takes its slice).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from multigpu.checkpoint.names import clean_state_dict, strip_name
from multigpu.errors import CheckpointError


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter, as a plain tensor sharing its storage (a DTensor's local shard)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor.detach()


class WeightAverage:
    """The averaged copy of ``model``'s parameters (``model``: the strategy's model, e.g. FSDP's)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        decay: Optional[float] = None,
        start: Optional[int] = None,
        keep_full: bool = True,
    ) -> None:
        if (decay is None) == (start is None):
            raise ValueError("give exactly one of decay (ema) and start (swa)")
        self.model = model
        self.decay = decay
        self.start = start
        #: Whether ``state_dict`` keeps the gathered tensors (rank 0 writes checkpoints; the others only
        #: take part in the gathering).
        self.keep_full = keep_full
        self.updates = 0
        by_id: dict[int, int] = {}
        self.params: list[nn.Parameter] = []
        self.names: list[list[str]] = []
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) not in by_id:
                by_id[id(param)] = len(self.params)
                self.params.append(param)
                self.names.append([])
            self.names[by_id[id(param)]].append(strip_name(name))
        with torch.no_grad():
            self.averaged = [_local(p).clone() for p in self.params]
        self._floating = [i for i, p in enumerate(self.params) if p.is_floating_point()]

    @property
    def kind(self) -> str:
        return "ema" if self.decay is not None else "swa"

    @property
    def active(self) -> bool:
        """True once the average holds something else than the initial weights."""
        return self.updates > 0

    def describe(self) -> str:
        return (
            f"ema {self.decay:g}"
            if self.decay is not None
            else f"equal-weight average from step {self.start}"
        )

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step ``step`` (counted from 1): no host synchronisation, one foreach call."""
        if self.start is not None and step < self.start:
            return
        current = [_local(p) for p in self.params]
        if self.updates == 0:
            torch._foreach_copy_(self.averaged, current)
        else:
            weight = 1.0 - self.decay if self.decay is not None else 1.0 / (self.updates + 1)
            floating = self._floating
            torch._foreach_lerp_(
                [self.averaged[i] for i in floating], [current[i] for i in floating], weight
            )
        self.updates += 1

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The model runs on the averaged weights inside (its own weights are put back after)."""
        if not self.active:
            yield
            return
        with torch.no_grad():
            current = [_local(p) for p in self.params]
            kept = [t.clone() for t in current]
            self._reshard()
            torch._foreach_copy_(current, self.averaged)
        try:
            yield
        finally:
            with torch.no_grad():
                # FSDP may keep gathered (averaged) weights after a forward without backward
                self._reshard()
                torch._foreach_copy_(current, kept)

    def _reshard(self) -> None:
        # loaded by the fsdp strategies, and only then needed
        fsdp = sys.modules.get("torch.distributed.fsdp")
        if fsdp is None:
            return
        for module in self.model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.reshard()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"averaging": counters, "averaged_model": plain full state dict}`` - the parameters gathered
        from every rank's shards (a collective under fsdp: every rank calls it), buffers from the model."""
        weights: dict[str, torch.Tensor] = {}
        for param, averaged, names in zip(self.params, self.averaged, self.names):
            full = _full(param, averaged)
            if self.keep_full:
                for name in names:
                    weights[name] = full.detach().to("cpu", copy=True)
        if self.keep_full:
            owned = {name for names in self.names for name in names}
            for name, value in clean_state_dict(self.model.state_dict()).items():
                if name not in owned and isinstance(value, torch.Tensor):
                    weights[name] = _full(value, _local(value)).detach().to("cpu", copy=True)
        return {
            "averaging": {
                "kind": self.kind,
                "decay": self.decay,
                "start": self.start,
                "updates": self.updates,
            },
            "averaged_model": weights,
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> bool:
        """Restore from a checkpoint's ``averaging``/``averaged_model`` (False: it holds none; the average
        starts from the next step). A checkpoint is data from disk: anything that does not fit is one line."""
        info, weights = state.get("averaging"), state.get("averaged_model")
        if info is None and weights is None:
            return False
        updates = info.get("updates") if isinstance(info, Mapping) else None
        if (
            not isinstance(updates, int)
            or isinstance(updates, bool)
            or updates < 0
            or not isinstance(weights, Mapping)
        ):
            raise CheckpointError(
                "the checkpoint's averaged model is malformed.",
                "it is corrupt; use an earlier one.",
            )
        for param, averaged, names in zip(self.params, self.averaged, self.names):
            full = weights.get(names[0])
            if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"the checkpoint's averaged model has no {names[0]} of shape "
                    f"{tuple(param.shape)}.",
                    "resume with the same model, or start a new out_dir.",
                )
            averaged.copy_(_slice(full.to(averaged.device, averaged.dtype), param))
        self.updates = updates
        return True


def _full(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's part, laid out like ``param`` (gathered for a DTensor)."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        raise TypeError(
            f"a parameter with a device_mesh but not a DTensor ({type(param).__name__})"
        )
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    ).full_tensor()


def _slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``, laid out like ``param`` (no communication: every rank holds ``full``)."""
    if not hasattr(param, "device_mesh"):
        return full
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        raise TypeError(
            f"a parameter with a device_mesh but not a DTensor ({type(param).__name__})"
        )
    return distribute_tensor(
        full, param.device_mesh, param.placements, src_data_rank=None
    ).to_local()
