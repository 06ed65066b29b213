"""Parallelism beyond data parallel: degrees on a DeviceMesh, the strategy table, and 2D (FSDP + tensor
parallel) and HSDP proven on 4 CPU processes against one process - equal within tolerance, sharded
checkpoints resharded 2x2 -> 1 and -> 4x1, and a bitwise-exact resume after a kill.

The 4-process runs are few and short (2 cores): one fixture trains each layout once; the tests compare.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, multigpu
from torch import nn

from multigpu.distributed.parallel import Parallelism
from multigpu.distributed.world import World
from multigpu.errors import ConfigError
from multigpu.strategies import NAMES, make_strategy, spec
from multigpu.strategies.tensor_parallel import resolve_plan

SCRIPT = str(SCRIPTS / "parallel2d.py")
CPU = [torch.device("cpu")]
#: float64 runs that differ only in the order of float sums stay within ~1e-9 (the bound is in
#: tests/scripts/parallel2d.py); 1e-7 leaves a factor of 100, far below a real difference (> 1e-3).
TOLERANCE = 1e-7


# ------------------------------------------------------------------ degrees and the table (no processes)


def test_degrees_multiply_to_the_world_and_tp_stays_in_a_node():
    p = Parallelism.from_degrees(8, 4, dp_replicate=2, tp=2)
    assert (p.dp_replicate, p.dp_shard, p.tp, p.dp_size) == (2, 2, 2, 4)
    # a tp group reads one shard
    assert [p.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [p.tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert p.dp_group_ranks(3) == [1, 3, 5, 7]
    assert Parallelism.from_degrees(4, 4).is_plain and Parallelism.from_degrees(4, 4).dp_size == 4
    for kwargs, needle in (
        ({"tp": 3}, "does not divide the world size 8"),
        ({"tp": 2, "dp_replicate": 2, "dp_shard": 3}, "but the world has 8"),
        ({"tp": 0}, "tp=0 must be"),
        ({"pp": 3}, "pp=3 x .* does not divide"),
    ):
        with pytest.raises(ConfigError, match=needle):
            Parallelism.from_degrees(8, 4, **kwargs)
    with pytest.raises(ConfigError, match="tp=4 would span nodes"):
        Parallelism.from_degrees(8, 2, tp=4)


def test_every_name_is_in_the_table_with_options_and_auto_is_a_rule():
    assert set(NAMES) == {
        "auto",
        "single",
        "dp",
        "ddp",
        "fsdp",
        "hsdp",
        "fsdp+tp",
        "pipeline",
        "ddp+pipeline",
        "pp+ddp",
        "pp+fsdp",
        "pp+hsdp",
        "pp+fsdp+tp",
        "ft-ddp",
    }
    for name in NAMES[1:]:
        entry = spec(name)
        assert entry.name == name and entry.summary
    two = World(rank=0, world_size=2, local_world_size=2)
    assert make_strategy("auto", World(), CPU).name == "single"
    # one process: nothing to replicate
    assert make_strategy("ddp+pipeline", World(), CPU).name == "pipeline"
    with pytest.raises(ConfigError, match="did you mean 'fsdp'"):
        make_strategy("fsdpp", World(), CPU)
    with pytest.raises(ConfigError, match="hsdp needs dp_replicate of 2 or more"):
        make_strategy("hsdp", two, CPU, mesh=lambda: None)
    with pytest.raises(ConfigError, match="ddp keeps a whole replica"):
        make_strategy(
            "ddp",
            World(rank=0, world_size=4, local_world_size=4),
            CPU,
            parallelism=Parallelism.from_degrees(4, 4, tp=2),
        )
    with pytest.raises(ConfigError, match="tp=2 needs strategy fsdp\\+tp"):
        make_strategy(
            "fsdp",
            World(rank=0, world_size=4, local_world_size=4),
            CPU,
            parallelism=Parallelism.from_degrees(4, 4, tp=2),
            mesh=lambda: None,
        )


def test_tensor_parallel_plans_are_checked_against_the_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    assert resolve_plan(model, {"0": "colwise", "2": "rowwise"}) == {"0": "colwise", "2": "rowwise"}
    with pytest.raises(ConfigError, match="needs a tensor-parallel plan"):
        resolve_plan(model, None)
    with pytest.raises(ConfigError, match="matches no module"):
        resolve_plan(model, {"*.q": "colwise"})
    with pytest.raises(ConfigError, match="only Linear layers"):
        resolve_plan(model, {"1": "colwise"})
    with pytest.raises(ConfigError, match="is not one of colwise, rowwise"):
        resolve_plan(model, {"0": "diagonal"})
    model.tp_plan = {"0": "colwise"}
    assert resolve_plan(model, None) == {"0": "colwise"}


# ------------------------------------------------------------------ 4 processes, for real


def _train(out: Path, nproc: int, *args: str, restarts: int = 0) -> dict:
    launch = [
        "run",
        "--nproc",
        str(nproc),
        *(["--max-restarts", str(restarts)] if restarts else []),
        SCRIPT,
        str(out),
    ]
    proc = multigpu(*launch, *args, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {**torch.load(out / "final.pt", weights_only=True), "stdout": proc.stdout}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout trained once, global batch 4, 6 AdamW steps: 2x2 fsdp+tp; HSDP 2x2; then one process
    trains in turn (parallel2d.py --plan, each run seeded as a fresh process): the plain reference, the
    reference with clipping, and plain fsdp continuing the 2x2 run's step-3 checkpoint."""
    root = tmp_path_factory.mktemp("parallel2d")
    found = {
        "root": root,
        "2d": _train(
            root / "2d", 4, "--strategy", "fsdp+tp", "--tp", "2", "--batch", "2", "--clip", "0.5"
        ),
        "hsdp": _train(
            root / "hsdp", 4, "--strategy", "hsdp", "--dp-replicate", "2", "--batch", "1"
        ),
    }
    source = root / "2d" / "checkpoints" / "step-00000003"
    (root / "continue1" / "checkpoints").mkdir(parents=True)
    shutil.copytree(source, root / "continue1" / "checkpoints" / source.name)
    one = {
        "single": ["--strategy", "single", "--batch", "4"],
        "single-clip": ["--strategy", "single", "--batch", "4", "--clip", "0.5"],
        "continue1": ["--strategy", "fsdp", "--batch", "4", "--clip", "0.5"],
    }
    (root / "plan.json").write_text(
        json.dumps([[str(root / name), *argv] for name, argv in one.items()])
    )
    proc = multigpu("run", "--nproc", "1", SCRIPT, "--plan", str(root / "plan.json"), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in one:
        found[name] = {
            **torch.load(root / name / "final.pt", weights_only=True),
            "stdout": proc.stdout,
        }
    return found


def _max_difference(a: dict, b: dict, losses: bool = True) -> float:
    """The largest difference of any weight or (with ``losses``) of any step's global loss."""
    assert sorted(a["weights"]) == sorted(b["weights"])
    weights = max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"])
    if not losses:
        return weights
    assert len(a["losses"]) == len(b["losses"]) > 0
    return max(weights, (a["losses"] - b["losses"]).abs().max().item())


# The first user of `runs` pays its three launches (two of 4 processes on 2 cores: minutes when busy).
@pytest.mark.timeout(600)
def test_fsdp_plus_tensor_parallel_2x2_equals_one_process(runs):
    single = runs["single-clip"]
    assert "4 processes: dp_shard 2 x tp 2" in runs["2d"]["stdout"]
    assert "done strategy=fsdp+tp world=4 dp=2 step=6" in runs["2d"]["stdout"]
    assert _max_difference(runs["2d"], single) < TOLERANCE


# Uses `runs` (its launches are paid by whichever test comes first).
@pytest.mark.timeout(600)
def test_hsdp_2x2_equals_one_process(runs):
    assert "done strategy=hsdp world=4 dp=4 step=6" in runs["hsdp"]["stdout"]
    assert _max_difference(runs["hsdp"], runs["single"]) < TOLERANCE


# One more launch, of 4 processes on 2 cores.
@pytest.mark.timeout(600)
def test_2x2_checkpoints_reshard_to_one_process_and_to_4x1(runs):
    """The step-3 checkpoint of the 2x2 run, continued by 1 process (in the fixture's one-process launch)
    and by 4 (plain fsdp), ends where the 2x2 run ended: model and AdamW state resharded by DCP."""
    continued = runs["continue1"]["stdout"].split(
        "done strategy=single world=1 dp=1 step=6 out=single-clip", 1
    )[1]
    assert "resumed from" in continued and "step 3)" in continued
    assert _max_difference(runs["continue1"], runs["2d"], losses=False) < TOLERANCE
    source = runs["root"] / "2d" / "checkpoints" / "step-00000003"
    folder = runs["root"] / "continue4"
    (folder / "checkpoints").mkdir(parents=True)
    shutil.copytree(source, folder / "checkpoints" / source.name)
    result = _train(folder, 4, "--strategy", "fsdp", "--batch", "1", "--clip", "0.5")
    assert "resumed from" in result["stdout"] and "step 3)" in result["stdout"]
    assert _max_difference(result, runs["2d"], losses=False) < TOLERANCE


# A 4-process launch that restarts once: two rounds of 4 workers on 2 cores.
@pytest.mark.timeout(600)
def test_2x2_resumes_bitwise_after_a_kill(runs):
    """Rank 1 is SIGKILLed in step 5; the agent restarts all four, which resume from step 4's shards."""
    out = runs["root"] / "killed"
    proc = multigpu(
        "run",
        "--nproc",
        "4",
        "--max-restarts",
        "1",
        SCRIPT,
        str(out),
        "--strategy",
        "fsdp+tp",
        "--tp",
        "2",
        "--batch",
        "2",
        "--clip",
        "0.5",
        "--kill-at",
        "4",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "step 4)" in proc.stdout
    final = torch.load(out / "final.pt", weights_only=True)["weights"]
    expected = runs["2d"]["weights"]
    assert all(torch.equal(final[k], expected[k]) for k in expected)
