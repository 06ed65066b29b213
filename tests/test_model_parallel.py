"""Pipeline splitting and FSDP block finding in one process; sharded checkpoints with real processes."""

from __future__ import annotations

import pytest
import torch
from conftest import SCRIPTS, multigpu, multigpu_here
from torch import nn

from multigpu.distributed.world import World
from multigpu.errors import ConfigError
from multigpu.strategies import make_strategy
from multigpu.strategies.fsdp import find_blocks
from multigpu.strategies.pipeline import (
    Pipeline,
    PipelineModule,
    PipelineOptions,
    balanced_split_points,
    split_model,
)

CPU = torch.device("cpu")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Linear(32, 16),
        nn.ReLU(),
        nn.Linear(16, 4),
    )


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("micro_batches", [1, 4, 64])
def test_pipeline_outputs_and_gradients_equal_the_unsplit_model(stages, micro_batches):
    model, reference = _mlp(), _mlp()
    layers, bounds = split_model(model, stages)
    piped = PipelineModule(layers, bounds, [CPU] * stages, micro_batches=micro_batches)
    x = torch.randn(10, 8)
    out, ref = piped(x), reference(x)
    assert torch.allclose(out, ref, atol=1e-6)
    (out**2).sum().backward()
    (ref**2).sum().backward()
    for (name, p), (_, q) in zip(
        piped.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    assert list(piped.state_dict()) == list(reference.state_dict())  # loads into the unsplit model


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split_points([10, 10, 10, 10], 2) == [2]
    assert balanced_split_points([1, 1, 1, 9], 2) == [3]
    points = balanced_split_points([5, 0, 5, 0, 5, 0], 3)
    assert points[0] in (1, 2) and points[1] in (3, 4)  # 5 | 5 | 5, zero-size layers go either side
    with pytest.raises(ConfigError, match="cannot split 2 layer"):
        balanced_split_points([1, 1], 3)


def test_explicit_split_points_and_list_of_stages():
    layers, bounds = split_model(_mlp(), 2, split_points=[4])
    assert bounds == [(0, 4), (4, 7)]
    stages = [nn.Linear(3, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2))]
    layers, bounds = split_model(stages, 2)
    assert bounds == [(0, 1), (1, 2)]
    piped = PipelineModule(layers, bounds, [CPU, CPU], micro_batches=2)
    x = torch.randn(6, 3)
    assert torch.allclose(piped(x), stages[1](stages[0](x)))


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(stages=2, split_points=[3, 5]), "2 split point(s) make 3 stages, not 2"),
        (dict(stages=2, split_points=[0]), "must increase strictly within 1..6"),
        (dict(stages=3, split_points=[5, 2]), "must increase strictly"),
    ],
)
def test_bad_split_points(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        split_model(_mlp(), **kwargs)
    assert needle in str(info.value)


def test_pipeline_needs_a_sequential_model():
    class Net(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ConfigError, match="splits an nn.Sequential"):
        split_model(Net(), 2)


def test_more_stages_than_gpus_of_the_process_is_a_hint_error():
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ConfigError) as info:
        Pipeline(devices, PipelineOptions(stages=4))
    assert "needs 4 GPUs but this process owns 2" in str(info.value)
    assert "--gpus-per-proc 4" in str(info.value)


def test_strategy_names_and_fallbacks():
    assert make_strategy("pipeline", World(), [CPU]).name == "pipeline"
    # one process: nothing to replicate
    assert make_strategy("ddp+pipeline", World(), [CPU]).name == "pipeline"
    # one process: nothing to shard, but checkpoints stay DCP
    alone = make_strategy("fsdp", World(), [CPU])
    assert (alone.name, alone.sharded, alone.distributed) == ("fsdp", True, False)
    with pytest.raises(ConfigError, match="fsdp option param_dtype='fp12'"):
        make_strategy(
            "fsdp", World(rank=0, world_size=2, local_world_size=2), [CPU], param_dtype="fp12"
        )
    with pytest.raises(ConfigError, match="has no option 'microbatches'"):
        make_strategy("pipeline", World(), [CPU], microbatches=2)


def test_fsdp_finds_repeated_blocks():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = nn.Linear(8, 8), nn.Linear(8, 32)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(8, 10)

    model = GPT()
    assert find_blocks(model) == list(model.blocks)
    assert find_blocks(model, ["Linear"]) == [
        m for m in model.modules() if isinstance(m, nn.Linear)
    ]
    with pytest.raises(ConfigError, match="matches no submodule.*Block"):
        find_blocks(model, ["Layer"])


# ------------------------------------------------------------------ sharded checkpoints, real processes


# Four launches of 1-3 processes plus two checkpoint commands (a few minutes on 2 busy cores).
@pytest.mark.timeout(300)
def test_sharded_checkpoint_reshards_2_to_1_and_3_and_consolidates(tmp_path, no_leftovers):
    script = str(SCRIPTS / "reshard.py")
    first = tmp_path / "two"
    multigpu(
        "run",
        "--nproc",
        "2",
        script,
        str(first),
        "--batch",
        "6",
        "--epochs",
        "1",
        "--weights",
        str(tmp_path / "after1.pt"),
        check=True,
    )
    (ckpt,) = (first / "checkpoints").glob("step-*")
    # 2 writing threads per rank
    assert (ckpt / ".metadata").exists() and len(list(ckpt.glob("*.distcp"))) == 2 * 2
    finals = {}
    for nproc, batch in ((2, 6), (1, 12), (3, 4)):  # the same global batch on every world size
        folder = tmp_path / f"cont{nproc}"
        (folder / "checkpoints").mkdir(parents=True)
        import shutil

        shutil.copytree(ckpt, folder / "checkpoints" / ckpt.name)
        proc = multigpu(
            "run",
            "--nproc",
            str(nproc),
            script,
            str(folder),
            "--batch",
            str(batch),
            "--epochs",
            "2",
            "--weights",
            str(tmp_path / f"final{nproc}.pt"),
            check=True,
        )
        assert "resumed from" in proc.stdout and "step 8)" in proc.stdout
        finals[nproc] = torch.load(tmp_path / f"final{nproc}.pt", weights_only=True)
    # float64: only the order of float sums differs (the bound: tests/scripts/reshard.py)
    for nproc in (1, 3):
        assert max((finals[nproc][k] - finals[2][k]).abs().max().item() for k in finals[2]) < 1e-7

    consolidated = multigpu_here(
        "checkpoint", "consolidate", str(ckpt), "--out", str(tmp_path / "plain"), check=True
    )
    assert "consolidated" in consolidated.stdout
    state = torch.load(tmp_path / "plain" / ckpt.name / "state.pt", weights_only=True)
    plain = nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    ).double()
    plain.load_state_dict(state["model"])  # strict
    after1 = torch.load(tmp_path / "after1.pt", weights_only=True)
    assert all(torch.equal(plain.state_dict()[k], after1[k]) for k in after1)
    listing = multigpu_here("checkpoint", "list", str(first / "checkpoints"), check=True)
    assert "sharded, world size 2  ok" in listing.stdout
