"""What a Trainer subclass writes: ``compute_loss``, and optionally metrics, model inputs and hooks.

Why a class of its own: this is the whole surface a recipe overrides (as Lightning's ModelHooks is for
a LightningModule), readable in one place without the loop's machinery; :class:`~multigpu.Trainer`
takes it as its base. Hooks are called on every rank, in the order of :mod:`multigpu.trainer.loop`'s
docstring.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from multigpu.trainer.batches import batch_length


class Hooks(abc.ABC):
    """The methods a Trainer subclass implements (``compute_loss``) or may override (the rest)."""

    # ------------------------------------------------------------------ your code
    @abc.abstractmethod
    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The loss of one batch (already on ``self.device``), averaged over its samples."""

    def evaluate_batch(self, batch: Any) -> Mapping[str, tuple[Any, Any]]:
        """Metric *sums* and counts for one evaluation batch: ``{"accuracy": (correct, n)}``.

        Sums and counts (not means) make the result over several processes exact. The default is the
        loss, weighted by the batch size.
        """
        n = batch_length(batch)
        return {"loss": (self.compute_loss(batch).detach() * n, n)}

    def model_inputs(self, batch: Any) -> Any:
        """What ``compute_loss`` passes to ``self.model`` (with pp: the first stage's input): ``batch[0]``."""
        return batch[0] if isinstance(batch, (tuple, list)) else batch

    # hooks (all optional; called on every rank; see the module docstring for the order)
    def on_fit_start(self) -> None:  # noqa: B027
        """Before the first batch (after a resume has restored the state)."""

    def on_epoch_start(self, epoch: int) -> None:  # noqa: B027
        """``epoch`` counts from 1."""

    def on_train_batch_end(self, step: int, loss: torch.Tensor) -> None:  # noqa: B027
        """After every batch; ``loss`` is this rank's, a tensor on the device (reading it syncs)."""

    def on_evaluate_start(self) -> None:  # noqa: B027
        """Before a validation pass (after an epoch, or every ``eval_every_steps``)."""

    def on_validation_end(self, metrics: Mapping[str, float]) -> None:  # noqa: B027
        """The global validation metrics, the same on every rank."""

    def on_epoch_end(self, epoch: int, metrics: Mapping[str, Any]) -> None:  # noqa: B027
        """After each epoch's validation, with the epoch's row (the same on every rank)."""

    def on_checkpoint(self, path: Path) -> None:  # noqa: B027
        """After a checkpoint was written (every rank; it exists when this is called)."""

    def on_fit_end(self) -> None:  # noqa: B027
        """After the last epoch (not after a preemption or an error)."""

    def rank_state(self) -> Optional[dict[str, Any]]:
        """This rank's own state to checkpoint (e.g. an LSTM's hidden state over a token stream).

        Saved for every rank, like the RNG states, and given back to the same rank by
        ``load_rank_state``. Tensors are moved to the CPU. Return None for nothing.
        """
        return None

    def load_rank_state(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore what ``rank_state`` returned on this rank. When the world size changed, rank r gets
        old rank r's state if there was one (a warning says which ranks got none)."""
