"""Hostile and malformed pipeline settings (pp, pipeline_schedule, micro_batches, split_points, mg.init(pp=)):
each is one ``multigpu: error: ... HINT: ...`` line and a non-zero exit, no traceback, nothing written
outside the output folder, no process left behind - the promises and the checks of
tests/test_hostile_inputs.py, whose case runner this table uses.

Settings are refused at the settings door (before any process starts a group); layouts that only the
model or the world can refute (a model that is not a Sequential, a split point it does not have, a pp
that does not divide the processes) are refused by every rank before the first step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO
from test_hostile_inputs import (
    HANG_S,
    Case,
    CaseServer,
    case_server,  # noqa: F401  (the fixture)
    test_hostile_input as check_case,
    write,
)

pytestmark = pytest.mark.timeout(120)
DIGITS = str(REPO / "examples" / "digits" / "train.py")


def trainer(
    pp: int = 2,
    model: str = "nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))",
    init: str = "",
    **settings: object,
) -> "callable":
    """A script training a tiny model with the Trainer and ``settings``, as s.py in the case folder."""
    extra = "".join(f", {k}={v!r}" for k, v in settings.items())
    return write(
        "s.py",
        "import torch, multigpu as mg; from torch import nn; from torch.utils.data import TensorDataset\n"
        "class T(mg.Trainer):\n"
        "    def compute_loss(self, b): return nn.functional.mse_loss(self.model(b[0]), b[1])\n"
        f"run = mg.init({init})\n"
        f"T(run, {model}, lambda p: torch.optim.SGD(p, lr=0.1), out_dir='out', progress=False, pp={pp}, "
        f"batch_size=4{extra}).fit(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)))\n",
    )


CASES = [
    # the settings door, through a recipe's KEY=VALUE overrides (the rest of the door: in-process, below)
    Case(
        "pp-zero",
        [DIGITS, "trainer.pp=0"],
        "trainer setting pp=0 is invalid",
        python=True,
        fresh=True,
    ),
    Case("pp-text", [DIGITS, "trainer.pp=two"], "trainer.pp must be int, not 'two'", python=True),
    Case(
        "pp-schedule-unknown",
        [DIGITS, "trainer.pp=2", "trainer.pipeline_schedule=zigzag"],
        "trainer setting pipeline_schedule='zigzag' is invalid",
        python=True,
    ),
    Case(
        "pp-micro-batches-not-dividing",
        [DIGITS, "trainer.pp=2", "trainer.micro_batches=3"],
        "micro_batches=3 is invalid",
        python=True,
    ),
    Case(
        "pp-split-points-bomb",
        [DIGITS, "trainer.pp=2", "trainer.split_points=[" + "1," * 10000 + "1]"],
        "HINT: write trainer.split_points: [a, b]",
        python=True,
    ),
    Case(
        "pp-schedule-without-pp",
        [DIGITS, "trainer.pipeline_schedule=gpipe"],
        "trainer setting pp=1 is invalid",
        python=True,
    ),
    Case(
        "pp-init-does-not-divide",
        ["s.py"],
        "pp=2 x dp_replicate=1 x tp=1 = 2 does not divide the world size 1",
        write("s.py", "import multigpu as mg\nmg.init(pp=2)\n"),
        python=True,
    ),
    # layouts the world or the model refute: every rank refuses before the first step
    Case(
        "pp-does-not-divide",
        ["run", "--nproc", "2", "s.py"],
        "pp=3 x dp_replicate=1 x tp=1 = 3 does not divide",
        trainer(pp=3, micro_batches=1),
    ),
    Case(
        "pp-not-sequential",
        ["run", "--nproc", "2", "s.py"],
        "pp splits an nn.Sequential into stages, not Linear",
        trainer(model="nn.Linear(2, 1)"),
    ),
    Case(
        "pp-split-point-unknown",
        ["run", "--nproc", "2", "s.py"],
        "split point 'head' is not a child",
        trainer(split_points=["head"]),
    ),
    Case(
        "pp-stage-without-parameters",
        ["run", "--nproc", "2", "s.py"],
        "pipeline stage 1 (1) owns no parameters",
        trainer(model="nn.Sequential(nn.Linear(2, 1), nn.Tanh())", split_points=[1]),
    ),
    Case(
        "pp-1f1b-too-few-micro-batches",
        ["run", "--nproc", "2", "s.py"],
        "1f1b needs at least one micro-batch",
        trainer(micro_batches=1),
    ),
]

#: Every pipeline setting's door in-process (the same TrainerSettings every path builds): value -> message.
DOOR = [
    ({"pp": True}, "trainer setting pp=True is invalid"),
    ({"pp": 10**11}, "trainer setting pp=100000000000 is invalid"),
    ({"pp": 2, "pipeline_schedule": "1f1b\nx"}, "trainer setting pipeline_schedule="),
    ({"pp": 2, "micro_batches": 0}, "trainer setting micro_batches=0 is invalid"),
    ({"pp": 2, "micro_batches": 2.5}, "trainer setting micro_batches=2.5 is invalid"),
    ({"pp": 2, "split_points": 3}, "trainer setting split_points=3 is invalid"),
    ({"pp": 2, "split_points": [1.5]}, "trainer setting split_points=1.5 is invalid"),
    ({"pp": 2, "split_points": [-1]}, "trainer setting split_points=-1 is invalid"),
    ({"pp": 2, "split_points": ["a\x07"]}, "trainer setting split_points="),
    ({"pp": 2, "split_points": [None]}, "trainer setting split_points=None is invalid"),
    ({"pp": 2, "compile": True}, "trainer setting compile=True is invalid"),
    ({"pp": 2, "precision": "16-mixed"}, "trainer setting precision='16-mixed' is invalid"),
    ({"pp": 2, "strategy_options": {"schedule": "gpipe"}}, "trainer setting strategy_options="),
    ({"micro_batches": 2}, "trainer setting pp=1 is invalid"),
    # the default: 2, one per stage
    ({"pp": 2, "batch_size": 3}, "trainer setting micro_batches=None is invalid"),
]


@pytest.mark.parametrize("values, message", DOOR, ids=[str(v) for v, _ in DOOR])
def test_every_pipeline_setting_is_typed_and_bounded_at_the_door(values, message):
    from multigpu.errors import ConfigError
    from multigpu.trainer.settings import TrainerSettings

    with pytest.raises(ConfigError) as caught:
        TrainerSettings.from_mapping(values)
    assert message in str(caught.value) and caught.value.hint and "\n" not in str(caught.value)


def test_the_table_is_unique():
    assert len({c.id for c in CASES}) == len(CASES) >= 10


# a case is killed at HANG_S (its launch of 2 processes included); the margin: setup
@pytest.mark.timeout(HANG_S + 60)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_pipeline_input(case: Case, tmp_path: Path, case_server: CaseServer):  # noqa: F811
    check_case(case, tmp_path, case_server)


@pytest.mark.parametrize(
    "sizes, stages, points, needle",
    [
        ([12, 0, 0, 5], 2, [1], None),  # stage 1 = (1, 2, 3) holds 5: fine
        ([12, 0, 5], 3, [1, 2], "pipeline stage 1 (1) owns no parameters"),
        ([0, 0, 12], 2, [1], "pipeline stage 0 (0) owns no parameters"),
        ([12, 5, 0, 0], 2, ["2"], "pipeline stage 1 (2, 3) owns no parameters"),
        # balanced: two of three stages cannot hold anything
        ([12, 0, 0], 3, None, "owns no parameters"),
    ],
)
def test_a_stage_without_parameters_is_one_line(sizes, stages, points, needle):
    """A stage of activations only had an empty optimizer and ended in torch's traceback; now refused."""
    from multigpu.errors import ConfigError
    from multigpu.strategies.pipeline_parallel import stage_bounds

    names = [str(i) for i in range(len(sizes))]
    if needle is None:
        assert stage_bounds(names, sizes, stages, points) == [(0, 1), (1, 4)]
        return
    with pytest.raises(ConfigError) as info:
        stage_bounds(names, sizes, stages, points)
    assert needle in str(info.value) and "HINT:" in str(info.value)
