"""Data: the project's samplers and loaders, and users' own loaders and streams adapted per rank.

``samplers``: the sharded training order (DistributedSampler's), exact evaluation shards, ``Loader``.
``adapt``: a user's Dataset, DataLoader or IterableDataset turned into this rank's loader.
Both loaders follow :class:`LoaderLike`, the one shape the Trainer and the Run rely on.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol, runtime_checkable


@runtime_checkable
class LoaderLike(Protocol):
    """What the training loop asks of a loader (``Loader`` for datasets, ``StreamLoader`` for streams)."""

    #: Samples per batch on this data-parallel rank.
    batch_size: int

    @property
    def length(self) -> Optional[int]:
        """Batches per epoch on this rank; None for a stream (its end is agreed across ranks)."""

    @property
    def dataset(self) -> Any: ...

    @property
    def samples(self) -> Optional[int]:
        """Samples in the whole dataset (every rank's share); None for a stream."""

    @property
    def num_workers(self) -> int:
        """Worker processes it forks (the Run settles its collectives before they are forked)."""

    def __iter__(self) -> Iterator[Any]: ...

    def set_epoch(self, epoch: int) -> None: ...

    def resume_at(self, epoch: int, batches_done: int) -> None:
        """The next pass is ``epoch``, starting after its first ``batches_done`` batches."""

    def position(self) -> tuple[int, int]:
        """Where to resume after the batch just trained on, as ``resume_at`` takes it."""

    def ends_after_current(self) -> bool:
        """True if the batch just yielded is this epoch's last on every rank."""

    def abandon(self) -> None:
        """Leaving by an exception: never wait for an agreement the other ranks may not join."""
