"""Loaders that shard data across ranks the way single-process training would see it.

Why: the classic DDP mistakes are a missing DistributedSampler (every rank trains on everything), a
forgotten ``set_epoch`` (the same order every epoch), a batch size that silently means something else,
and evaluation on padded duplicates. Here the sampler is always there (a world of one is just one
shard), the epoch advances by itself, the global batch is stated at start, and evaluation shards
carry no padding, so a metric over N processes equals the single-process value exactly.

The training order is DistributedSampler's (the same permutation for a seed and an epoch), so N
processes with batch b see, step by step, exactly the samples one process with batch N*b sees.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional, Sized

import torch
from torch.utils.data import DataLoader, Sampler
from typing_extensions import override

from multigpu.errors import ConfigError


class ShardedSampler(Sampler[int]):
    """This rank's share of a (shuffled) epoch, resumable part-way through.

    Same indices as ``torch.utils.data.DistributedSampler`` for the same arguments; adds
    ``skip(n)`` so a resumed run continues with the sample after the last one it trained on.
    """

    def __init__(
        self,
        length: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        self.length = length
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._skip = 0
        if drop_last and length % num_replicas:
            self.num_samples = length // num_replicas
        else:
            self.num_samples = math.ceil(length / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, samples: int) -> None:
        """Leave out the first ``samples`` indices of this rank's next pass (resume inside an epoch)."""
        self._skip = max(0, min(samples, self.num_samples))

    def epoch_indices(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.length, generator=generator).tolist()
        else:
            indices = list(range(self.length))
        if self.drop_last:
            indices = indices[: self.total_size]
        elif len(indices) < self.total_size:
            padding = self.total_size - len(indices)
            indices += (indices * math.ceil(padding / max(len(indices), 1)))[:padding]
        return indices[self.rank : self.total_size : self.num_replicas]

    @override
    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        return iter(self.epoch_indices()[skip:])

    def __len__(self) -> int:
        return self.num_samples - self._skip


class EvalSampler(Sampler[int]):
    """Every sample exactly once across ranks, no padding: rank r takes r, r+W, r+2W, ..."""

    def __init__(self, length: int, num_replicas: int = 1, rank: int = 0) -> None:
        self.length, self.num_replicas, self.rank = length, num_replicas, rank

    @override
    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))


_EPOCH_SEED = 1_000_003
_STREAM_SEED = 998_244_353


def epoch_generator_seed(seed: int, epoch: int, stream: int = 0) -> int:
    """The seed of a loader's generator for one epoch: DataLoader draws its workers' base seed from it.

    ``stream`` (the data-parallel rank, unless identical streams were asked for) keeps the workers of
    different ranks from drawing the same augmentations.
    """
    return (_EPOCH_SEED * (seed + 1) + epoch + _STREAM_SEED * stream) % (2**63)


class Loader:
    """A DataLoader over this rank's shard that reshuffles every epoch by itself.

    Iterating it runs one epoch and moves to the next; ``set_epoch`` (the PyTorch tutorial's call)
    still works and wins. ``batch_size`` is per process.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        sampler: Sampler[Any],
        batch_size: int,
        world_size: int,
        seed: int = 0,
        stream: int = 0,
    ) -> None:
        self.loader = loader
        self.sampler = sampler
        self.seed = seed
        self.stream = stream
        self.batch_size = batch_size
        self.world_size = world_size
        self.epoch = 0
        self._resume_batches = 0
        self._done = 0  # batches of the current pass yielded so far (counting the skipped ones)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, batches_done: int) -> None:
        """The next pass is ``epoch``, starting after its first ``batches_done`` batches."""
        self.epoch = epoch
        self._resume_batches = batches_done

    def position(self) -> tuple[int, int]:
        """Where to resume after the batch just trained on, as ``resume_at(*position)`` takes it.

        Save this in a checkpoint rather than ``loader.epoch``: inside the loop over an epoch's last
        batch, ``epoch`` still names that epoch (it advances when the loop asks for the next batch), and
        resuming there would train the whole epoch again."""
        if self._done >= len(self.loader):
            return self.epoch + 1, 0
        return self.epoch, self._done

    def __iter__(self) -> Iterator[Any]:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        if self.loader.generator is not None:
            # DataLoader draws its workers' base seed from this generator when an epoch starts; one
            # seeded per epoch keeps the global RNG untouched and makes a resumed epoch identical.
            self.loader.generator.manual_seed(
                epoch_generator_seed(self.seed, self.epoch, self.stream)
            )
        if self._resume_batches and isinstance(self.sampler, ShardedSampler):
            self.sampler.skip(self._resume_batches * self.batch_size)
        self._done = self._resume_batches if isinstance(self.sampler, ShardedSampler) else 0
        self._resume_batches = 0
        for batch in self.loader:
            self._done += 1
            yield batch
        self.epoch += 1
        self._done = 0

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def length(self) -> Optional[int]:
        """Batches per epoch on this rank (a stream's loader has None)."""
        return len(self.loader)

    @property
    def num_workers(self) -> int:
        return self.loader.num_workers

    @property
    def samples(self) -> Optional[int]:
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def ends_after_current(self) -> bool:
        """True after the epoch's last batch (every rank has the same number of batches)."""
        return self._done >= len(self.loader)

    def abandon(self) -> None:
        """Nothing to abandon: a dataset's epoch needs no agreement between ranks."""


def _length(dataset: Any) -> int:
    if not isinstance(dataset, Sized):
        raise ConfigError(
            f"{type(dataset).__name__} has no len(); a sharded loader needs to know the dataset size.",
            "pass it as an IterableDataset (its share is read by each rank), or give it a __len__.",
        )
    return len(dataset)


def make_loader(
    dataset: Any,
    batch_size: int,
    *,
    rank: int,
    world_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    evaluation: bool = False,
    pin_memory: bool = False,
    stream: int = 0,
    **dataloader_kwargs: Any,
) -> Loader:
    """A :class:`Loader` for this rank. ``evaluation``: every sample once, no padding, no shuffle."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(
            f"batch_size {batch_size!r} must be a positive integer.", "it is per process: e.g. 32."
        )
    for reserved in ("sampler", "batch_sampler", "shuffle"):
        if reserved in dataloader_kwargs:
            raise ConfigError(
                f"run.loader() chooses the sampler itself; got {reserved}=.",
                "drop it, or build your own DataLoader and pass it where a loader is expected.",
            )
    length = _length(dataset)
    if evaluation:
        sampler: Sampler[Any] = EvalSampler(length, world_size, rank)
    else:
        sampler = ShardedSampler(
            length, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
    dataloader_kwargs.setdefault("generator", torch.Generator())
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last and not evaluation,
        pin_memory=pin_memory,
        **dataloader_kwargs,
    )
    return Loader(loader, sampler, batch_size, world_size, seed, stream)


def describe_batch(
    batch_size: int,
    world_size: int,
    accumulation: int = 1,
    length: Optional[int] = None,
    unit: str = "process",
) -> str:
    """The sentence printed at start, so nobody trains a week with the wrong effective batch.

    ``world_size``: how many ranks read different data (the data-parallel size); ``unit`` names them.
    """
    global_batch = batch_size * world_size * accumulation
    parts = [
        f"batch {batch_size} per {unit}",
        f"{world_size} {unit}(es)" if unit == "process" else f"{world_size} {unit}s",
    ]
    if accumulation > 1:
        parts.append(f"{accumulation} accumulation steps")
    text = " x ".join(parts) + f" = global batch {global_batch}"
    if length is not None:
        text = f"{length} samples, " + text
    return text
