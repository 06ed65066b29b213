"""The in-process half of ``multigpu check``: records what each training step did, then ends the run.

Why inside the script: the check must run the user's own code, unchanged, and still see each step's
loss, how many samples each rank got, whether ranks saw the same inputs or drew the same random
numbers, which parameters got no gradient, and the weights after K steps. ``mg.init`` creates a
:class:`Probe` only when ``multigpu check`` set :data:`DIR_VAR`; otherwise ``run.probe`` is None and
costs one attribute test per backward.

What it changes, identically in both runs of the check: dropout is switched off (``p = 0``) so that
N processes and one process compute the same function, and loaders built by ``run.loader`` (the
Trainer's included) get ``batch x SCALE`` samples per step in the one-process run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

DIR_VAR = "MULTIGPU_CHECK_DIR"
STEPS_VAR = "MULTIGPU_CHECK_STEPS"
SCALE_VAR = "MULTIGPU_CHECK_BATCH_SCALE"


class CheckDone(SystemExit):
    """Raised after the K-th optimizer step: the check has what it needs; the process exits 0."""

    def __init__(self) -> None:
        super().__init__(0)


def from_environment(rank: int) -> Optional["Probe"]:
    folder = os.environ.get(DIR_VAR)
    if not folder:
        return None
    return Probe(Path(folder), rank, steps=int(os.environ.get(STEPS_VAR, "5")),
                 scale=int(os.environ.get(SCALE_VAR, "1")))


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _digest(tensor: torch.Tensor, limit: int = 1 << 20) -> str:
    flat = tensor.detach().reshape(-1)[:limit].cpu()
    return hashlib.sha256(flat.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class Probe:
    """Per-rank recorder: one JSON line per optimizer step in ``DIR/rank<R>.jsonl``; rank 0 saves
    the weights after the last step to ``DIR/weights.pt`` (and a ``model.json`` with the layers found)."""

    def __init__(self, folder: Path, rank: int, steps: int, scale: int) -> None:
        self.folder, self.rank, self.steps, self.scale = folder, rank, steps, scale
        folder.mkdir(parents=True, exist_ok=True)
        self._log = open(folder / f"rank{rank}.jsonl", "w", encoding="utf-8")
        self.step = 0
        self._losses: list[float] = []
        self._samples = 0
        self._inputs: list[str] = []
        self._rng: list[str] = []
        self._used: set[int] = set()
        self._names: dict[int, str] = {}
        self._model: Optional[nn.Module] = None
        self._run: Any = None
        self._compute_dtype: Optional[str] = None
        self._eval_samples = 0
        self._averaged_scalars = 0
        self._loader_samples = False  # True once a run.loader loader counts the samples

    # ------------------------------------------------------------------ attach
    def attach(self, run: Any, wrapped: nn.Module, inner: nn.Module, optimizer: Any) -> None:
        """Called by ``run.setup``: hooks on the model and on every optimizer's step, dropout off, the
        layers noted. Only the first model set up is compared (a second one - a teacher, a GAN's other
        half - still trains, and every ``optimizer.step()`` of any optimizer counts as a step)."""
        if self._model is not None:
            return
        self._run, self._model = run, wrapped
        dropouts = 0
        for module in inner.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
                module.p = 0.0
                dropouts += 1
        batchnorms = [name for name, m in inner.named_modules()
                      if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)]
        for name, param in inner.named_parameters():
            if param.requires_grad:
                self._names[id(param)] = name
                param.register_post_accumulate_grad_hook(lambda p: self._used.add(id(p)))
        wrapped.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        # Global: also an optimizer built after run.setup (`model, _ = run.setup(model)`; opt = SGD(...)).
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(lambda opt, args, kwargs: self._on_step())
        self._watch_averages()
        self._save_weights("weights0.pt")  # a collective for sharded models: every rank is in setup
        if self.rank == 0:
            (self.folder / "model.json").write_text(json.dumps({
                "dropouts_disabled": dropouts, "batchnorms": batchnorms[:20], "batchnorm_count": len(batchnorms),
                "scale": self.scale, "world_size": run.world_size, "dp_size": run.dp_size,
                "strategy": getattr(run.strategy, "name", "?")}))

    # ------------------------------------------------------------------ hooks
    def _watch_averages(self) -> None:
        """Count all-reduces that average a few numbers (a metric's per-rank mean): with uneven
        evaluation shards, the mean of the ranks' means is not the mean. Only in a check's processes."""
        import torch.distributed as dist

        original = dist.all_reduce
        if getattr(original, "_multigpu_probe", False):
            return

        def all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
            if op == dist.ReduceOp.AVG and isinstance(tensor, torch.Tensor) and tensor.numel() <= 16:
                self._averaged_scalars += 1
            return original(tensor, op, *args, **kwargs)

        all_reduce._multigpu_probe = True  # type: ignore[attr-defined]
        dist.all_reduce = all_reduce

    def _save_weights(self, name: str) -> None:
        weights = self._run.state_dict(self._model)
        if self.rank == 0:
            torch.save(weights, self.folder / name)

    def count(self, loader: Any) -> "CountingLoader":
        """Wrap a training loader built by ``run.loader``: samples are counted as it yields batches
        (the collated batch's first dimension), not from the model's input, which may be (time, batch)."""
        self._loader_samples = True
        return CountingLoader(loader, self)

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = _first_tensor(args) if args else _first_tensor(kwargs)
        if not module.training:
            self._eval_samples += int(first.shape[0]) if first is not None and first.dim() else 0
            return
        if self._compute_dtype is None:
            device = first.device.type if first is not None else "cpu"
            enabled = torch.is_autocast_enabled(device) if device in ("cuda", "cpu") else False
            self._compute_dtype = str(torch.get_autocast_dtype(device) if enabled else
                                      next((p.dtype for p in module.parameters()), torch.float32)).replace("torch.", "")
        if first is not None:
            if not self._loader_samples:
                self._samples += int(first.shape[0]) if first.dim() else 1
            self._inputs.append(_digest(first))
        self._rng.append(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16])

    def record_loss(self, loss: torch.Tensor) -> None:
        """Every backward's loss (the Trainer's and ``run.backward``'s); a step's loss is their mean."""
        self._losses.append(float(loss.detach().float().mean().item()))

    def _on_step(self) -> None:
        self.step += 1
        record = {"step": self.step, "loss": sum(self._losses) / len(self._losses) if self._losses else None,
                  "samples": self._samples, "inputs": self._inputs, "rng": self._rng, "dtype": self._compute_dtype,
                  "eval_samples": self._eval_samples, "averaged_scalars": self._averaged_scalars}
        if self.step == 1:
            record["no_grad"] = [name for key, name in self._names.items() if key not in self._used][:50]
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()
        self._losses, self._samples, self._inputs, self._rng = [], 0, [], []
        if self.step == 1:
            self._save_weights("weights1.pt")  # every rank finishes step 1 here: a collective is safe
        if self.step >= self.steps:
            self._save_weights("weights.pt")
            self._log.close()
            raise CheckDone()


class CountingLoader:
    """A training loader that tells the probe how many samples each batch holds; everything else is
    the wrapped loader's (attributes, ``len``, resuming)."""

    def __init__(self, loader: Any, probe: Probe) -> None:
        self._loader, self._probe = loader, probe

    def __iter__(self):
        for batch in self._loader:
            first = _first_tensor(batch)
            if first is not None:
                self._probe._samples += int(first.shape[0]) if first.dim() else 1
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
