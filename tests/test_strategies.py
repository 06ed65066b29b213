"""Strategies in one process: choice by name, options, DataParallel's CPU fallback, precision."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multigpu as mg
from multigpu.distributed.world import World
from multigpu.errors import ConfigError
from multigpu.strategies import DataParallelStrategy, SingleDevice, make_strategy
from multigpu.trainer.precision import Precision

CPU = [torch.device("cpu")]


def test_auto_is_single_in_a_world_of_one_and_ddp_in_a_bigger_one():
    assert make_strategy("auto", World(), CPU).name == "single"
    # DDP of one process is plain training
    assert make_strategy("ddp", World(), CPU).name == "single"


def test_unknown_strategy_and_option_are_errors_with_hints():
    with pytest.raises(
        ConfigError, match="unknown strategy 'ddpp'.*HINT: did you mean 'ddp'\\? choose one of"
    ):
        make_strategy("ddpp", World(), CPU)
    with pytest.raises(ConfigError, match="has no option 'find_unused'.*find_unused_parameters"):
        make_strategy("ddp", World(rank=0, world_size=2, local_world_size=2), CPU, find_unused=True)


def test_dp_on_cpu_warns_and_trains_like_single():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = make_strategy("dp", World(), CPU)
    messages = [str(w.message) for w in caught]
    assert any("deprecated" in m and "ddp" in m for m in messages)
    assert any("running on the CPU as 'single'" in m for m in messages)
    assert isinstance(strategy, DataParallelStrategy)
    torch.manual_seed(0)
    model, optimizer = strategy.setup(nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    torch.manual_seed(0)
    ref_model, ref_opt = SingleDevice(CPU[0]).setup(
        nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    for m, o in ((model, optimizer), (ref_model, ref_opt)):
        F.mse_loss(m(x), y).backward()
        o.step()
    assert torch.equal(model.weight, ref_model.weight)


def test_optimizer_factory_must_return_an_optimizer():
    with pytest.raises(mg.MultiGPUError, match="factory returned"):
        SingleDevice(CPU[0]).setup(nn.Linear(2, 2), lambda params: "adam")


@pytest.mark.parametrize("mode", ["32", "bf16", "fp16"])
def test_precision_modes_train_on_cpu(mode):
    precision = Precision(mode, CPU[0])
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with precision.autocast():
        loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,)))
    precision.scale(loss).backward()
    precision.unscale(optimizer)
    assert precision.step(optimizer)
    assert not torch.equal(before, model.weight)
    assert (mode == "fp16") == bool(precision.state_dict())


def test_unknown_precision_is_an_error():
    with pytest.raises(ConfigError, match="unknown precision 'fp8'"):
        Precision("fp8")


def test_trainer_settings_reject_unknown_keys():
    class T(mg.Trainer):
        def compute_loss(self, batch):
            return batch

    with pytest.raises(
        ConfigError, match="the Trainer has no setting 'epoch'.*did you mean 'epochs'"
    ):
        T(mg.init(), nn.Linear(1, 1), lambda p: torch.optim.SGD(p, lr=0.1), epoch=3)


@pytest.mark.parametrize(
    "name, instead", [("single", "ddp"), ("dp", "ddp"), ("pipeline", "ddp+pipeline")]
)
def test_strategies_without_sync_are_refused_in_a_multi_process_job(name, instead):
    world = World(rank=0, world_size=2, local_world_size=2)
    with pytest.raises(ConfigError) as info:
        make_strategy(name, world, CPU)
    assert "keeps no replicas in sync" in str(info.value) and instead in info.value.hint


def test_resume_off_with_old_checkpoints_is_refused(tmp_path):
    class T(mg.Trainer):
        def compute_loss(self, batch):
            return F.mse_loss(self.model(batch[0]), batch[1])

    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    run = mg.init()
    T(
        run,
        nn.Linear(2, 1),
        lambda p: torch.optim.SGD(p, lr=0.1),
        out_dir=str(tmp_path),
        progress=False,
        batch_size=4,
    ).fit(data)
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run and resume is off"):
        T(
            run,
            nn.Linear(2, 1),
            lambda p: torch.optim.SGD(p, lr=0.1),
            out_dir=str(tmp_path),
            progress=False,
            batch_size=4,
            resume=False,
        ).fit(data)


def test_trainer_uses_the_strategy_given_to_init():
    class T(mg.Trainer):
        def compute_loss(self, batch):
            return batch

    run = mg.init(strategy="pipeline")
    trainer = T(
        run, nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    assert trainer.strategy.name == "pipeline"


def test_rebuilt_optimizer_keeps_its_hyperparameters():
    from multigpu.strategies.base import rebuild_optimizer

    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rebuilt = rebuild_optimizer(optimizer, {id(p): n for n, p in model.named_parameters()}, model)
    assert rebuilt is not optimizer and rebuilt.param_groups[0]["lr"] == 0.1


def test_a_trainer_keeps_the_degrees_given_to_init_unless_its_settings_say():
    """Issue 51 (degrees from three places): `mg.init(tp=2)` and a Trainer with default settings ran tp 1 -
    the settings' tp=1 default silently replaced init's 2 before the model was set up. Settings that leave
    every degree at 1 now take the Run's; settings that name one are the Trainer's (as before)."""
    from multigpu.distributed.parallel import Parallelism
    from multigpu.trainer.settings import TrainerSettings

    inits = Parallelism.from_degrees(4, 4, tp=2, pp=2)
    kept = TrainerSettings().with_degrees(inits)
    assert (kept.tp, kept.dp_replicate, kept.pp) == (2, 1, 2)
    # pp's own
    assert kept.setup_options() == {"schedule": "1f1b", "micro_batches": None, "split_points": None}
    said = TrainerSettings(dp_replicate=2).with_degrees(inits)
    assert (said.tp, said.dp_replicate, said.pp) == (1, 2, 1)
    with pytest.raises(ConfigError, match="micro_batches"):  # pp's checks run on the degrees taken
        TrainerSettings(batch_size=3).with_degrees(inits)
    assert TrainerSettings().with_degrees(Parallelism.plain(4)) == TrainerSettings()
