"""Users' data as it arrives: a Dataset, a DataLoader they built, or an IterableDataset (a stream).

Why: most real scripts already have a DataLoader (with a tokenizer's collate function, workers, pinned
memory) or a stream (Hugging Face ``datasets`` in streaming mode, WebDataset-style readers). Asking
them to take it apart loses settings; using it as is loses the sharding. Here:

- a **DataLoader** is rebuilt for this rank with the project's sampler (exact resume, every sample once
  per epoch across ranks), keeping its batch size, ``collate_fn``, workers, pinned memory, timeouts,
  ``worker_init_fn``, ``prefetch_factor``, ``persistent_workers`` and the rest - the way Accelerate's
  ``prepare_data_loader`` and Lightning's re-injection do. What cannot be re-sharded without changing
  its meaning (a custom batch sampler, a custom sampler, ``batch_size=None``) is refused with a HINT;
- an **IterableDataset** is read by this rank and each of its workers in a disjoint share: item ``i``
  goes to the one (rank, worker) with ``i mod (ranks x workers) == rank x workers + worker``. A
  Hugging Face streaming dataset is split with ``datasets.distributed.split_dataset_by_node`` (it
  spreads its shards over the workers itself); any dataset with a ``split_by_node(rank, world_size)``
  method is split by that method. **Uneven ends:** in training every rank stops at the batch where the
  shortest share ends (an all-reduce MIN of "I have a next batch" per batch, overlapped with the step),
  so no rank waits for a batch that never comes; in evaluation every rank reads its whole share, so
  every sample counts once. A resumed epoch skips the samples each worker already delivered.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    get_worker_info,
)
from typing_extensions import override

from multigpu.data.samplers import Loader, epoch_generator_seed, make_loader
from multigpu.distributed.agreement import Pending
from multigpu.errors import ConfigError

#: DataLoader settings carried over to the rebuilt loader (each is an attribute of the same name).
KEPT = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)
_WORKER_ONLY = ("prefetch_factor", "persistent_workers", "multiprocessing_context")


def dataloader_settings(loader: DataLoader[Any]) -> dict[str, Any]:
    """What to keep of a user's DataLoader; refuses what cannot be re-sharded."""
    name = type(loader).__name__
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        raise ConfigError(
            f"the {name} uses a custom batch sampler ({type(loader.batch_sampler).__name__}), which "
            "decides its batches itself: multigpu cannot shard it without changing them.",
            "pass the dataset (and batch_size) instead, or shard in your sampler with run.dp_rank / "
            "run.dp_size and pass a plain iterable.",
        )
    if loader.batch_sampler is None:
        raise ConfigError(
            f"the {name} yields single samples (batch_size=None): there is no batch to shard.",
            "give the DataLoader a batch_size, or pass the dataset itself.",
        )
    kept = {key: getattr(loader, key) for key in KEPT if hasattr(loader, key)}
    if not kept.get("num_workers"):
        for key in _WORKER_ONLY:
            kept.pop(key, None)
    # A plain BatchSampler given by hand holds the batch size and drop_last itself.
    return {
        **kept,
        "batch_size": loader.batch_sampler.batch_size,
        "drop_last": loader.batch_sampler.drop_last,
    }


def sampler_order(loader: DataLoader[Any]) -> tuple[bool, Optional[int]]:
    """(shuffle, seed) of the user's sampler, for the samplers whose order ours reproduces."""
    # a plain BatchSampler or None (dataloader_settings checked)
    batch_sampler = loader.batch_sampler
    sampler = batch_sampler.sampler if isinstance(batch_sampler, BatchSampler) else loader.sampler
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle), int(sampler.seed)
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            raise ConfigError(
                "the DataLoader samples with replacement or a fixed number of samples, which is not "
                "an epoch of the dataset.",
                "pass the dataset and shuffle instead.",
            )
        return True, None
    if type(sampler) is SequentialSampler:
        return False, None
    raise ConfigError(
        f"the DataLoader uses a custom sampler ({type(sampler).__name__}); its order cannot be split "
        "across ranks without changing it.",
        "pass the dataset (shuffle: true/false), or build one loader per rank with run.dp_rank/run.dp_size.",
    )


def adapt(
    data: Any,
    *,
    dp_rank: int,
    dp_size: int,
    batch_size: int,
    evaluation: bool,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    pin_memory: bool = False,
    collate_fn: Optional[Callable[..., Any]] = None,
    num_workers: int = 0,
    rank_streams: bool = True,
    agree: Optional[Callable[[], Optional[Pending]]] = None,
    batch_scale: int = 1,
    **dataloader_kwargs: Any,
) -> "Loader | StreamLoader":
    """A loader of this rank's share of ``data`` (a Loader, a DataLoader, an IterableDataset or a Dataset).

    ``rank_streams``: workers' random seeds differ between ranks (augmentations are not repeated on
    every rank). ``agree``: makes the per-batch end agreement of training streams (None: no agreement,
    one process or evaluation). ``batch_scale``: multiplies the batch size (``multigpu check``'s
    one-process run, which must see in one batch what N ranks see together).
    """
    if isinstance(data, (Loader, StreamLoader)):
        return data
    kwargs = dict(dataloader_kwargs)
    if collate_fn is not None:
        kwargs.setdefault("collate_fn", collate_fn)
    if num_workers:
        kwargs.setdefault("num_workers", num_workers)
    if isinstance(data, DataLoader):
        settings = dataloader_settings(data)
        settings["pin_memory"] = settings.get("pin_memory") or pin_memory
        batch_size, drop_last = settings.pop("batch_size") * batch_scale, settings.pop("drop_last")
        if isinstance(data.dataset, IterableDataset):
            return StreamLoader(
                data.dataset,
                batch_size,
                dp_rank,
                dp_size,
                evaluation=evaluation,
                drop_last=drop_last,
                seed=seed,
                rank_streams=rank_streams,
                agree=None if evaluation else agree,
                **settings,
            )
        loader_shuffle, loader_seed = sampler_order(data)
        return make_loader(
            data.dataset,
            batch_size,
            rank=dp_rank,
            world_size=dp_size,
            evaluation=evaluation,
            shuffle=loader_shuffle,
            seed=seed if loader_seed is None else loader_seed,
            drop_last=drop_last,
            stream=dp_rank if rank_streams else 0,
            **settings,
        )
    batch_size *= batch_scale
    if isinstance(data, IterableDataset):
        return StreamLoader(
            data,
            batch_size,
            dp_rank,
            dp_size,
            evaluation=evaluation,
            drop_last=drop_last,
            seed=seed,
            rank_streams=rank_streams,
            agree=None if evaluation else agree,
            pin_memory=pin_memory,
            **kwargs,
        )
    return make_loader(
        data,
        batch_size,
        rank=dp_rank,
        world_size=dp_size,
        evaluation=evaluation,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        pin_memory=pin_memory,
        stream=dp_rank if rank_streams else 0,
        **kwargs,
    )


# ------------------------------------------------------------------------------------------ streams


def _is_hf_stream(dataset: Any) -> bool:
    return type(dataset).__module__.split(".")[0] == "datasets" and hasattr(dataset, "_ex_iterable")


class RankShare(IterableDataset[Any]):
    """This rank's share of a stream, split again across the DataLoader's workers, resumable by count."""

    def __init__(
        self,
        dataset: Any,
        rank: int,
        size: int,
        batch_size: int,
        skip_batches: int = 0,
        split_workers: bool = True,
    ) -> None:
        self.dataset, self.rank, self.size, self.batch_size = dataset, rank, size, batch_size
        self.skip_batches, self.split_workers = skip_batches, split_workers

    @override
    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, loader_worker = (info.num_workers, info.id) if info is not None else (1, 0)
        # With in-order loading, batch b came from worker b mod workers. A resumed loader starts asking
        # its worker 0 again, so worker 0 plays the part of the worker whose turn it was: same order.
        worker = (loader_worker + self.skip_batches) % workers
        skip = len(range(worker, self.skip_batches, workers)) * self.batch_size
        if self.split_workers:
            stride, offset = self.size * workers, self.rank * workers + worker
            mine = (item for index, item in enumerate(self.dataset) if index % stride == offset)
        else:  # split by node already; the dataset spreads its shards over the workers itself
            mine = iter(self.dataset)
        return itertools.islice(mine, skip, None)


_END = object()


class StreamLoader:
    """Batches of this rank's share of an iterable dataset; ends agreed across ranks in training.

    Has no ``len()`` (``length`` is None): the epoch ends when the shortest share does.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        rank: int,
        size: int,
        *,
        evaluation: bool = False,
        drop_last: bool = False,
        seed: int = 0,
        rank_streams: bool = True,
        agree: Optional[Callable[[], Optional[Pending]]] = None,
        **dataloader_kwargs: Any,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(
                f"batch_size {batch_size!r} must be a positive integer.",
                "it is per process: e.g. 32.",
            )
        for reserved in ("sampler", "batch_sampler", "shuffle"):
            if reserved in dataloader_kwargs:
                raise ConfigError(
                    f"an iterable dataset takes no {reserved}=: it decides its own order.",
                    "shuffle inside the dataset (e.g. datasets' .shuffle(seed=...)).",
                )
        self.batch_size, self.rank, self.size = batch_size, rank, size
        self.evaluation, self.drop_last, self.seed = evaluation, drop_last, seed
        self.stream = rank if rank_streams else 0
        self.agree = agree
        self.kwargs = dataloader_kwargs
        self.epoch = 0
        self.length: Optional[int] = None
        self._resume_batches = 0
        self._done = 0  # batches of the current pass yielded so far (counting the skipped ones)
        self._pending: Any = _END
        self._agreement: Optional[Pending] = None
        if _is_hf_stream(dataset):
            from datasets.distributed import split_dataset_by_node

            self.dataset, self._split_workers = (
                split_dataset_by_node(dataset, rank=rank, world_size=size),
                False,
            )
        elif hasattr(dataset, "split_by_node"):
            self.dataset, self._split_workers = dataset.split_by_node(rank, size), True
            # the hook returned this rank's share: only workers are left to split
            self.rank, self.size = 0, 1
        else:
            self.dataset, self._split_workers = dataset, True

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, batches_done: int) -> None:
        self.epoch, self._resume_batches = epoch, batches_done

    def position(self) -> tuple[int, int]:
        """Where to resume after the batch just trained on (see ``Loader.position``); at a stream's last
        batch of an epoch this waits for the end-of-stream agreement, like ``ends_after_current``."""
        if self._done and self.ends_after_current():
            return self.epoch + 1, 0
        return self.epoch, self._done

    @property
    def num_workers(self) -> int:
        return int(self.kwargs.get("num_workers") or 0)

    @property
    def samples(self) -> Optional[int]:
        return None  # a stream's length is not known ahead

    def __len__(self) -> int:
        raise TypeError(
            "a stream has no length: its epoch ends when the shortest rank's share ends"
        )

    def abandon(self) -> None:
        if self._agreement is not None:
            self._agreement.abandon()

    def ends_after_current(self) -> bool:
        """True if the batch just yielded is the last of this epoch on every rank (waits for the agreement)."""
        if self._agreement is None:
            return self._pending is _END
        return not self._agreement.result()[0]

    def __iter__(self) -> Iterator[Any]:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        source = RankShare(
            self.dataset,
            self.rank,
            self.size,
            self.batch_size,
            self._resume_batches,
            self._split_workers,
        )
        self._done = self._resume_batches
        self._resume_batches = 0
        generator = torch.Generator()
        generator.manual_seed(epoch_generator_seed(self.seed, self.epoch, self.stream))
        loader = DataLoader(
            source,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            generator=generator,
            **self.kwargs,
        )
        batches = iter(loader)
        self._pending = next(batches, _END)
        self._agreement = self.agree() if self.agree is not None else None
        if self._agreement is not None:
            self._agreement.start([int(self._pending is not _END)])
        try:
            while True:
                if self._agreement is not None and not self._agreement.result()[0]:
                    break
                if self._pending is _END:
                    break
                current = self._pending
                self._pending = next(batches, _END)
                if self._agreement is not None:
                    # finishes while the step runs
                    self._agreement.start([int(self._pending is not _END)])
                self._done += 1
                yield current
        finally:
            if self._agreement is not None:
                # stopped early on every rank (max_steps): complete the last one
                self._agreement.finish()
        self.epoch += 1
        self._done = 0
