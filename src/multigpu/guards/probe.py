"""The in-process half of ``multigpu check``: records what each training step did, then ends the run.

Why inside the script: the check must run the user's own code, unchanged, and still see what each
step trained on - how many forward passes (micro-steps) it made and how many samples each held, a
digest of every rank's inputs, the random state, whether the gradients were synchronised, each step's
loss, which parameters got no gradient, and the weights. ``mg.init`` creates a :class:`Probe` only when
``multigpu check`` asked for one (the job's ``check`` section); otherwise ``run.probe`` is :data:`NO_PROBE`, whose
hooks are no-op method calls.

What is counted where, and why there:

- samples, micro-steps, input digests, gradient sync: at the *model's* forward (a pre-hook on what
  ``run.setup`` returned), whatever produced the batch - ``run.loader``, a plain DataLoader, random
  offsets (nanoGPT's ``get_batch``). A loader built by ``run.loader`` only tells the forward where the
  batch dimension is (a ``(time, batch, ...)`` input);
- the loss: every value given to a backward (``run.backward``, the Trainer, or ``loss.backward()``
  itself), divided back by a GradScaler's scale; a step's loss is their sum, so a loss divided by the
  accumulation steps (nanoGPT, the Trainer) sums back to the script's own loss;
- mistakes that are wrong on any number of processes: gradients clipped while a GradScaler still
  scales them, an LR scheduler stepped on every micro-step, a metric averaged over the ranks' means.

What it changes, identically in both runs of the check: dropout is switched off (``p = 0``) so that
N processes and one process compute the same function, and loaders built by ``run.loader`` (the
Trainer's included) get ``batch x SCALE`` samples per step in the one-process run. Every patch and
hook is removed again when the probe closes (after the K-th step).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from multigpu.distributed.job import Job
from multigpu.fileio import Folder
from multigpu.guards.digests import first_tensor, rng_digest, tensor_digest, tensors_in

#: After its K-th step a rank waits this long at most for the others to reach theirs (they normally
#: arrive within milliseconds: the K-th step follows the same all-reduce on every rank).
PEER_WAIT_S = 60.0


class CheckDone(SystemExit):
    """Raised after the K-th optimizer step: the check has what it needs; the process exits 0."""

    def __init__(self) -> None:
        super().__init__(0)


def from_job(job: Job, rank: int) -> "Probe | NoProbe":
    """The recorder ``multigpu check`` asked for (its section of the Job), or NO_PROBE."""
    if job.check is None:
        return NO_PROBE
    return Probe(Path(job.check.dir), rank, steps=job.check.steps, scale=job.check.scale)


class Probe:
    """Per-rank recorder: one JSON line per optimizer step in ``DIR/rank<R>.jsonl``; rank 0 saves the
    weights after setup, step 1 and step K (``weights0.pt``, ``weights1.pt``, ``weights.pt``) and a
    ``model.json`` with the layers found."""

    def __init__(self, folder: Path, rank: int, steps: int, scale: int) -> None:
        self.folder, self.rank, self.steps, self.scale = folder, rank, steps, scale
        # check's own temporary folder (mkdtemp), via the file door
        self.records = Folder(folder).create()
        self._log = self.records.open_append(f"rank{rank}.jsonl")
        self.step = 0
        self.world_size = 1
        self._names: dict[int, str] = {}
        self._used: set[int] = set()
        self._model: Optional[nn.Module] = None
        self._inner: Optional[nn.Module] = None
        self._run: Any = None
        self._replicated = False
        self._compute_dtype: Optional[str] = None
        self._eval_samples = 0
        self._averaged_scalars = 0
        self._total_forwards = 0
        # the last run.loader batch's size: where the batch dimension is
        self._loader_rows: Optional[int] = None
        # run.backward / the Trainer report losses: the backward patch stays quiet
        self._explicit_losses = False
        self._scalers: list[Any] = []
        self._undo: list[Callable[[], None]] = []
        self._closed = False
        self._new_step()

    def _new_step(self) -> None:
        self._losses: list[float] = []
        self._rows: list[int] = []
        self._inputs: list[str] = []
        self._rng: list[str] = []
        self._sync: list[Optional[bool]] = []
        self._loader_batches: list[int] = []
        self._inner_forwards = 0
        self._scheduler_steps = 0
        self._clipped_scaled = 0
        self._scaled: dict[int, float] = {}

    # ------------------------------------------------------------------ attach
    def attach(self, run: Any, wrapped: nn.Module, inner: nn.Module, optimizer: Any) -> None:
        """Called by ``run.setup``: hooks on the model and on every optimizer's step, dropout off, the
        layers noted. Only the first model set up is compared (a second one - a teacher, a GAN's other
        half - still trains, and every ``optimizer.step()`` of any optimizer counts as a step)."""
        if self._model is not None or self._closed:
            return
        self._run, self._model, self._inner = run, wrapped, inner
        self.world_size = run.world_size
        strategy = getattr(run.strategy, "name", "?")
        # Replicas (plain DDP) must hold bitwise-equal weights after every step; sharded strategies do not.
        self._replicated = strategy == "ddp" and not getattr(run.strategy, "sharded", False)
        dropouts = 0
        for module in inner.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
                module.p = 0.0
                dropouts += 1
        batchnorms = [
            name
            for name, m in inner.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and not isinstance(m, nn.SyncBatchNorm)
        ]
        for name, param in inner.named_parameters():
            if param.requires_grad:
                self._names[id(param)] = name
                handle = param.register_post_accumulate_grad_hook(lambda p: self._used.add(id(p)))
                self._undo.append(handle.remove)
        self._undo.append(
            wrapped.register_forward_pre_hook(self._on_forward, with_kwargs=True).remove
        )
        # calls that go around the wrapper (model.module(x)) reach only this one
        if inner is not wrapped:
            self._undo.append(inner.register_forward_pre_hook(self._on_inner_forward).remove)
        # Global: also an optimizer built after run.setup (`model, _ = run.setup(model)`; opt = SGD(...)).
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._undo.append(
            register_optimizer_step_post_hook(lambda opt, args, kwargs: self._on_step(opt)).remove
        )
        self._patch_all_reduce()
        self._patch_backward()
        self._patch_scaler()
        self._patch_clipping()
        self._patch_schedulers()
        self._save_weights("weights0.pt")  # a collective for sharded models: every rank is in setup
        if self.rank == 0:
            self.records.write_atomic(
                "model.json",
                json.dumps(
                    {
                        "dropouts_disabled": dropouts,
                        "batchnorms": batchnorms[:20],
                        "batchnorm_count": len(batchnorms),
                        "scale": self.scale,
                        "world_size": run.world_size,
                        "dp_size": run.dp_size,
                        "strategy": strategy,
                        "replicated": self._replicated,
                    }
                ),
            )

    def close(self) -> None:
        """Remove every hook and patch (also when the script failed before the K-th step)."""
        if self._closed:
            return
        self._closed = True
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if not self._log.closed:
            self._log.close()

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    # ------------------------------------------------------------------ patches (only in a check's processes)
    def _patch_all_reduce(self) -> None:
        """Count all-reduces that average a few numbers (a metric's per-rank mean): with uneven
        evaluation shards, the mean of the ranks' means is not the mean."""
        import torch.distributed as dist

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def all_reduce(
                tensor: Any, op: Any = dist.ReduceOp.SUM, *args: Any, **kwargs: Any
            ) -> Any:
                if (
                    op == dist.ReduceOp.AVG
                    and isinstance(tensor, torch.Tensor)
                    and tensor.numel() <= 16
                ):
                    self._averaged_scalars += 1
                return original(tensor, op, *args, **kwargs)

            return all_reduce

        self._patch(dist, "all_reduce", make)

    def _patch_backward(self) -> None:
        """``loss.backward()`` called by the script itself: its loss is recorded too."""

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if not self._explicit_losses and tensor.numel() == 1 and tensor.requires_grad:
                    self._losses.append(self._unscaled(tensor))
                return original(tensor, *args, **kwargs)

            return backward

        self._patch(torch.Tensor, "backward", make)

    def _patch_scaler(self) -> None:
        """Remember what a GradScaler multiplied, to report the loss undivided by its scale and to see
        gradients clipped before ``scaler.unscale_``."""

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def scale(scaler: Any, outputs: Any) -> Any:
                result = original(scaler, outputs)
                if isinstance(result, torch.Tensor) and scaler.is_enabled():
                    self._scaled[id(result)] = float(scaler.get_scale())
                    if all(s is not scaler for s in self._scalers):
                        self._scalers.append(scaler)
                return result

            return scale

        self._patch(torch.amp.GradScaler, "scale", make)

    def _patch_clipping(self) -> None:
        from torch.amp.grad_scaler import OptState

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
                if self._scaled and not any(
                    state.get("stage") is OptState.UNSCALED
                    for scaler in self._scalers
                    for state in scaler._per_optimizer_states.values()
                ):
                    # a loss was scaled this step and nothing was unscaled yet
                    self._clipped_scaled += 1
                return original(*args, **kwargs)

            return clip_grad_norm_

        self._patch(torch.nn.utils, "clip_grad_norm_", make)

    def _patch_schedulers(self) -> None:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
                if getattr(scheduler, "_step_count", 0) >= 1:  # 0: the step the constructor takes
                    self._scheduler_steps += 1
                return original(scheduler, *args, **kwargs)

            return step

        self._patch(torch.optim.lr_scheduler.LRScheduler, "step", make)

    def _unscaled(self, loss: torch.Tensor) -> float:
        return float(loss.detach().float().mean().item()) / self._scaled.get(id(loss), 1.0)

    # ------------------------------------------------------------------ hooks
    def _save_weights(self, name: str) -> None:
        weights = self._run.state_dict(self._model)
        if self.rank == 0:
            with self.records.open_new(name) as handle:
                torch.save(weights, handle)

    def count(self, loader: Any) -> "CountingLoader":
        """Wrap a training loader built by ``run.loader``: its batches' sizes tell the forward hook where
        the batch dimension of the model's input is (``(time, batch, ...)`` inputs)."""
        return CountingLoader(loader, self)

    def _batch_rows(self, first: torch.Tensor) -> int:
        """Samples in one forward: the input's first dimension - or, when a ``run.loader`` batch of B
        samples was just drawn and B is another of the input's dimensions, B."""
        if not first.dim():
            return 1
        rows = int(first.shape[0])
        if (
            self._loader_rows is not None
            and rows != self._loader_rows
            and self._loader_rows in first.shape[1:]
        ):
            return self._loader_rows
        return rows

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensors = tensors_in((args, kwargs), [])
        first = tensors[0] if tensors else None
        if not module.training:
            self._eval_samples += int(first.shape[0]) if first is not None and first.dim() else 0
            return
        if self._compute_dtype is None:
            device = first.device.type if first is not None else "cpu"
            enabled = torch.is_autocast_enabled(device) if device in ("cuda", "cpu") else False
            self._compute_dtype = str(
                torch.get_autocast_dtype(device)
                if enabled
                else next(
                    (p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32
                )
            ).replace("torch.", "")
        self._rows.append(self._rows_of(first))
        self._inputs.append(tensor_digest(tensors) if tensors else "")
        self._rng.append(rng_digest(first.device if first is not None else None))
        # DDP's no_sync() (and nanoGPT's toggle) set this; the forward decides whether the backward syncs.
        sync = getattr(module, "require_backward_grad_sync", None)
        self._sync.append(None if sync is None else bool(sync))
        self._inner_forwards -= 1  # the wrapper's own call of the inner module is not a bypass
        self._total_forwards += 1
        if self.world_size > 1:
            self.records.write_atomic(f"progress.rank{self.rank}", str(self._total_forwards))

    def _rows_of(self, first: Optional[torch.Tensor]) -> int:
        return self._batch_rows(first) if first is not None else 0

    def _on_inner_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training:
            self._inner_forwards += 1

    def record_loss(self, loss: torch.Tensor, accumulation: int = 1) -> None:
        """The value given to a backward by ``run.backward`` or the Trainer (a step's loss is their sum:
        the Trainer's micro-batch losses count 1/accumulation each). Once these come, ``loss.backward()``
        calls are no longer recorded besides them."""
        if not self._explicit_losses:
            self._explicit_losses = True
            self._losses = []  # the Trainer reports after its backward: drop the implicit copy
        self._losses.append(self._unscaled(loss) / accumulation)

    def trainer_settings(self, settings: Any) -> Any:
        """A Trainer under the check writes into the check's own folder, never the user's outputs."""
        import dataclasses

        return dataclasses.replace(
            settings, out_dir=str(self.folder / "trainer_out"), loggers=[], plot=False
        )

    def loader(self, loader: Any, evaluation: bool) -> Any:
        return loader if evaluation else self.count(loader)

    def batch_scale(self, evaluation: bool) -> int:
        return 1 if evaluation else self.scale

    @staticmethod
    def _params_digest(params: list[Any]) -> str:
        return tensor_digest(params) if params else ""

    def _on_step(self, optimizer: Any) -> None:
        if self._closed:
            return
        self.step += 1
        record = {
            "step": self.step,
            "loss": sum(self._losses) if self._losses else None,
            "backwards": len(self._losses),
            "forwards": len(self._rows),
            "rows": self._rows,
            "samples": sum(self._rows),
            "inputs": self._inputs,
            "rng": self._rng,
            "sync": self._sync,
            "loader_batches": self._loader_batches,
            "bypass": max(self._inner_forwards, 0),
            "dtype": self._compute_dtype,
            "eval_samples": self._eval_samples,
            "averaged_scalars": self._averaged_scalars,
            "scheduler_steps": self._scheduler_steps,
            "clipped_scaled": self._clipped_scaled,
            "dp_rank": getattr(self._run, "dp_rank", self.rank),
        }
        if self.step == 1:
            record["no_grad"] = [
                name for key, name in self._names.items() if key not in self._used
            ][:50]
            outside = [
                p
                for group in getattr(optimizer, "param_groups", [])
                for p in group["params"]
                if id(p) not in self._names
            ]
            record["outside"] = len(outside)
            record["outside_digest"] = self._params_digest(outside)
        # set by attach
        if (
            self._replicated
            and self._inner is not None
            and (self.step == 1 or self.step >= self.steps)
        ):
            record["weights_digest"] = self._params_digest(list(self._inner.parameters()))
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()
        self._new_step()
        if self.step == 1:
            # every rank finishes step 1 here: a collective is safe
            self._save_weights("weights1.pt")
        if self.step >= self.steps:
            self._finish()

    def _finish(self) -> None:
        self._save_weights("weights.pt")
        self.close()
        if self.world_size > 1:
            self.records.write_atomic(f"done.rank{self.rank}", str(self._total_forwards))
            missing = self._wait_for_peers()
            if missing:
                # They went on without stepping (an optimizer step on some ranks only): they are in a
                # collective this rank will never join, so leave without the goodbye barrier.
                self.records.write_atomic(
                    f"stranded.rank{self.rank}.json", json.dumps({"missing": missing})
                )
                self._run.interrupted(
                    f"multigpu check: rank(s) {missing} did not reach step {self.steps}"
                )
        raise CheckDone()

    def _wait_for_peers(self) -> list[int]:
        """The ranks that did not reach step K: gone past this rank's forward count without stepping
        (seen in their progress files), or not there after :data:`PEER_WAIT_S`."""
        deadline = time.monotonic() + PEER_WAIT_S
        past_since: dict[int, float] = {}
        while True:
            missing = [
                r for r in range(self.world_size) if not (self.folder / f"done.rank{r}").exists()
            ]
            now = time.monotonic()
            for r in missing:
                if self._forwards_of(r) > self._total_forwards:
                    past_since.setdefault(r, now)
            # A rank past this one's forward count for 2 s without a done file is not coming.
            gone = [r for r in missing if now - past_since.get(r, now) > 2.0]
            if not missing or gone == missing or now > deadline:
                return missing
            time.sleep(0.02)

    def _forwards_of(self, rank: int) -> int:
        try:
            return int(self.records.load_text(f"progress.rank{rank}", limit=64) or 0)
        except (OSError, ValueError):
            return 0


class CountingLoader:
    """A training loader that tells the probe the size of each batch it yields; everything else is
    the wrapped loader's (attributes, ``len``, resuming)."""

    def __init__(self, loader: Any, probe: Probe) -> None:
        self._loader, self._probe = loader, probe

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            first = first_tensor(batch)
            if first is not None and first.dim():
                self._probe._loader_rows = int(first.shape[0])
                self._probe._loader_batches.append(int(first.shape[0]))
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class NoProbe:
    """What a run has when ``multigpu check`` did not start it: every hook a no-op method call (the
    Run and the Trainer call the hooks unconditionally instead of testing for a recorder each time)."""

    active = False

    def attach(self, run: Any, wrapped: nn.Module, inner: nn.Module, optimizer: Any) -> None:
        pass

    def record_loss(self, loss: torch.Tensor, accumulation: int = 1) -> None:
        pass

    def trainer_settings(self, settings: Any) -> Any:
        return settings

    def loader(self, loader: Any, evaluation: bool) -> Any:
        return loader

    def batch_scale(self, evaluation: bool) -> int:
        return 1


NO_PROBE = NoProbe()
