"""Samplers and loaders: every sample once per epoch across ranks, new order each epoch, no padding in
evaluation, resume part-way through an epoch, and the stated global batch."""

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from multigpu.data.samplers import EvalSampler, ShardedSampler, describe_batch, make_loader
from multigpu.errors import ConfigError
from multigpu.strategies import split_sizes


@pytest.mark.parametrize("length, world", [(100, 2), (101, 2), (101, 3), (7, 4)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_indices_as_torch_distributed_sampler(length, world, shuffle):
    data = list(range(length))
    for epoch in (0, 3):
        for rank in range(world):
            ours = ShardedSampler(length, world, rank, shuffle=shuffle, seed=5)
            theirs = DistributedSampler(data, world, rank, shuffle=shuffle, seed=5)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)


@pytest.mark.parametrize("world", [2, 3])
def test_every_sample_exactly_once_per_epoch_across_ranks(world):
    length = 120  # divisible: no padding
    for epoch in range(3):
        seen = []
        for rank in range(world):
            sampler = ShardedSampler(length, world, rank, seed=1)
            sampler.set_epoch(epoch)
            seen += list(sampler)
        assert sorted(seen) == list(range(length))


def test_padding_only_repeats_to_even_out_shards():
    seen = []
    for rank in range(3):
        seen += list(ShardedSampler(101, 3, rank, seed=1))
    assert len(seen) == 102 and set(seen) == set(range(101))


def test_order_changes_between_epochs_and_is_reproducible():
    sampler = ShardedSampler(200, 2, 0, seed=9)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert orders[0] != orders[1] != orders[2]
    sampler.set_epoch(1)
    assert list(sampler) == orders[1]


def test_global_batches_match_one_process_with_the_global_batch():
    """Rank r's k-th batch of size b, over all ranks, is one process's k-th batch of size W*b."""
    length, world, b = 96, 2, 4
    single = list(ShardedSampler(length, 1, 0, seed=3))
    shards = [list(ShardedSampler(length, world, r, seed=3)) for r in range(world)]
    for k in range(length // (world * b)):
        union = sorted(i for shard in shards for i in shard[k * b : (k + 1) * b])
        assert union == sorted(single[k * world * b : (k + 1) * world * b])


def test_eval_sampler_has_no_padding():
    shards = [list(EvalSampler(101, 3, r)) for r in range(3)]
    assert [len(s) for s in shards] == [34, 34, 33]
    assert sorted(i for s in shards for i in s) == list(range(101))


def test_loader_reshuffles_every_epoch_by_itself_and_resumes_mid_epoch():
    data = TensorDataset(torch.arange(40))
    loader = make_loader(data, 4, rank=0, world_size=2, seed=2)
    first = [b[0].tolist() for b in loader]
    second = [b[0].tolist() for b in loader]
    assert first != second and loader.epoch == 2
    assert len(sum(first, [])) == len(sum(second, [])) == 20
    loader.resume_at(1, batches_done=3)
    resumed = [b[0].tolist() for b in loader]
    assert resumed == second[3:]
    loader.set_epoch(0)
    assert [b[0].tolist() for b in loader] == first


def test_loader_rejects_bad_arguments():
    data = TensorDataset(torch.arange(10))
    with pytest.raises(ConfigError, match="batch_size 0"):
        make_loader(data, 0, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="chooses the sampler itself"):
        make_loader(data, 2, rank=0, world_size=1, sampler=None)
    with pytest.raises(ConfigError, match="has no len"):
        make_loader(iter([1, 2]), 2, rank=0, world_size=1)


def test_describe_batch_states_the_global_batch():
    assert describe_batch(32, 4, 2, length=1000) == (
        "1000 samples, batch 32 per process x 4 process(es) x 2 accumulation steps = global batch 256"
    )
    assert describe_batch(16, 1) == "batch 16 per process x 1 process(es) = global batch 16"


@pytest.mark.parametrize("batch, n", [(64, 4), (10, 4), (3, 4), (1, 2), (0, 3), (33, 8)])
def test_dataparallel_split_rule_matches_torch_chunk(batch, n):
    expected = [len(c) for c in torch.arange(batch).chunk(n)] if batch else []
    assert split_sizes(batch, n) == expected
    assert sum(split_sizes(batch, n)) == batch


def test_position_after_an_epochs_last_batch_is_the_next_epoch():
    from multigpu.data.samplers import make_loader

    loader = make_loader(list(range(12)), 4, rank=0, world_size=1, shuffle=True, seed=0)
    seen = []
    for _ in loader:
        seen.append(loader.position())
    assert seen == [(0, 1), (0, 2), (1, 0)]  # at the last batch, loader.epoch is still 0
    resumed = make_loader(list(range(12)), 4, rank=0, world_size=1, shuffle=True, seed=0)
    resumed.resume_at(0, 2)
    batches = list(resumed)
    assert len(batches) == 1 and resumed.position() == (1, 0)
    resumed.resume_at(*seen[0])
    assert [b.tolist() for b in resumed] == [
        b.tolist()
        for b in list(make_loader(list(range(12)), 4, rank=0, world_size=1, shuffle=True, seed=0))
    ][1:]


def test_move_to_keeps_the_batch_structure_and_accepts_any_mapping():
    from collections import OrderedDict, defaultdict, namedtuple

    from multigpu.trainer.batches import batch_length, move_to

    pair = namedtuple("pair", "x y")
    batch = {
        "a": (torch.ones(3, 2), [torch.zeros(3)]),
        "b": pair(torch.ones(3), 7),
        "c": OrderedDict(d=torch.ones(3)),
    }
    moved = move_to(batch, torch.device("cpu"), non_blocking=False)
    assert type(moved["b"]) is pair and moved["b"].y == 7 and type(moved["c"]) is OrderedDict
    assert torch.equal(moved["a"][0], batch["a"][0]) and batch_length(moved) == 3
    # its constructor takes a factory: a plain dict comes back
    counts = defaultdict(list, x=torch.ones(2))
    assert torch.equal(move_to(counts, torch.device("cpu"))["x"], torch.ones(2))
