"""Pipeline parallelism across processes (pp) and 3D layouts, proven on CPU processes against one process.

A tiny GPT (float64, tests/scripts/pipeline_train.py), global batch 8, 6 AdamW steps, gradient clipping at
0.5 (across stages and meshes), against one process with the global batch: every step's global loss,
every weight, and an exact validation loss (13 samples: uneven data-parallel shards, short batches and
padded micro-batches). Launches are few (2 cores): each layout is launched once and trains several
configurations in turn; the tests compare. The 8-process 3D layout is marked slow.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, kill_all, multigpu, wait_until_gone

from multigpu.checkpoint.sharded import consolidate
from multigpu.distributed.parallel import Parallelism
from multigpu.distributed.world import World
from multigpu.errors import ConfigError
from multigpu.strategies import make_strategy, resolve_name
from multigpu.strategies.pipeline_parallel import stage_bounds, stages_per_rank
from multigpu.strategies.schedules import check_micro_batches, take

SCRIPT = str(SCRIPTS / "pipeline_train.py")
#: float64 runs that differ only in the order of float sums (micro-batches, reductions) stay within ~1e-9
#: after 6 AdamW steps (a gradient's relative error ~1e-15, amplified at most lr / eps = 3e5 per step; see
#: tests/scripts/parallel2d.py); measured here ~5e-14. A real difference (a lost micro-batch, a stage's
#: gradient not averaged, a wrong clip) is above 1e-3.
TOLERANCE = 1e-7
CLIP = ("--clip", "0.5")


# ------------------------------------------------------------------ the layout and the split (no processes)


def test_pp_is_the_outermost_degree_so_a_stage_is_a_block_of_consecutive_ranks():
    p = Parallelism.from_degrees(8, 8, pp=2, tp=2)
    assert (p.pp, p.dp_shard, p.tp, p.dp_size, p.stage_size) == (2, 2, 2, 2, 4)
    assert [p.pp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # both stages read the same shards
    assert [p.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [p.tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert p.dp_group_ranks(5) == [5, 7] and p.pp_group_ranks(5) == [1, 5]
    assert p.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert p.describe() == "pp 2 x dp_shard 2 x tp 2" and not p.is_plain
    assert Parallelism.from_degrees(4, 4, pp=2).describe() == "pp 2 x dp 2"
    assert Parallelism.from_degrees(2, 2, pp=2).dp_size == 1
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        Parallelism.from_degrees(6, 6, pp=4)
    with pytest.raises(ConfigError, match="pp=0 must be"):
        Parallelism.from_degrees(4, 4, pp=0)


def test_a_pipeline_strategy_is_the_named_one_per_stage_and_the_rest_are_refused():
    two = World(rank=0, world_size=2, local_world_size=2)
    assert [resolve_name(n, two, pp=2) for n in ("auto", "ddp", "fsdp", "fsdp+tp", "pp+hsdp")] == [
        "pp+ddp",
        "pp+ddp",
        "pp+fsdp",
        "pp+fsdp+tp",
        "pp+hsdp",
    ]
    for name in ("single", "dp", "pipeline", "ddp+pipeline"):
        with pytest.raises(ConfigError, match="does not run pipeline stages across processes"):
            resolve_name(name, two, pp=2)
    with pytest.raises(ConfigError, match="needs pp of 2 or more"):
        make_strategy(
            "pp+fsdp",
            two,
            [torch.device("cpu")],
            parallelism=Parallelism.plain(2),
            mesh=lambda: None,
        )


def test_stages_split_at_named_children_or_balanced_by_parameters():
    names = ["embed", "b0", "b1", "b2", "head"]
    sizes = [10, 30, 30, 30, 40]
    assert stage_bounds(names, sizes, 2, None) == [(0, 3), (3, 5)]
    assert stage_bounds(names, sizes, 2, ["b1"]) == [(0, 2), (2, 5)]
    assert stage_bounds(names, sizes, 4, ["b0", 2, "b2"]) == [(0, 1), (1, 2), (2, 3), (3, 5)]
    with pytest.raises(ConfigError, match="did you mean 'b1'"):
        stage_bounds(names, sizes, 2, ["b11"])
    with pytest.raises(ConfigError, match="increasing order"):
        stage_bounds(names, sizes, 3, ["b2", "b1"])
    with pytest.raises(ConfigError, match="make 2 stages, but the pipeline has 4"):
        stage_bounds(names, sizes, 4, ["b1"])
    assert (
        stages_per_rank("interleaved_1f1b", 2, None) == 2
        and stages_per_rank("1f1b", 2, ["b1"]) == 1
    )
    with pytest.raises(ConfigError, match="runs one stage per rank"):
        stages_per_rank("gpipe", 2, ["b0", "b1", "b2"])
    with pytest.raises(ConfigError, match="needs at least 2 stages per rank"):
        stages_per_rank("interleaved_1f1b", 2, ["b1"])
    check_micro_batches("gpipe", 1, 4)
    with pytest.raises(ConfigError, match="at least one micro-batch per stage"):
        check_micro_batches("1f1b", 2, 4)


def test_a_micro_batch_takes_the_rows_of_every_part_of_the_batch():
    batch = {
        "x": torch.arange(12).view(6, 2),
        "names": list("abcdef"),
        "scale": torch.tensor(2.0),
        "pair": (torch.arange(6), torch.zeros(3)),
    }
    micro = take(batch, 2, 4, rows=6)
    assert micro["x"].tolist() == [[4, 5], [6, 7]] and micro["names"] == ["c", "d"]
    assert (
        micro["scale"].item() == 2.0
        and micro["pair"][0].tolist() == [2, 3]
        and micro["pair"][1].shape == (3,)
    )


# ------------------------------------------------------------------ real processes


def _train(
    out: Path, nproc: int, token: str, *args: str, restarts: int = 0, status: int = 0
) -> str:
    launch = [
        "run",
        "--nproc",
        str(nproc),
        *(["--max-restarts", str(restarts)] if restarts else []),
        SCRIPT,
        str(out),
    ]
    proc = multigpu(*launch, *args, "--token", token, timeout=420)
    assert proc.returncode == status, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def _result(folder: Path) -> dict:
    return torch.load(folder / "final.pt", weights_only=True)


def _max_difference(a: dict, b: dict, losses: bool = True) -> float:
    """The largest difference of any weight, of any step's global loss (with ``losses``) and of validation."""
    assert sorted(a["weights"]) == sorted(b["weights"])
    weights = max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"])
    if not losses:
        return weights
    assert len(a["losses"]) == len(b["losses"]) == 6
    return max(
        weights, (a["losses"] - b["losses"]).abs().max().item(), abs(a["valid"] - b["valid"])
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four launches: pp 2 x dp 2 (4 processes) with ddp, with fsdp, and with ddp accumulating 2 micro-steps
    of batch 2 per step; one process - the reference, then
    the fsdp run's step-3 checkpoint continued; pp 2 (2 processes) with each schedule, then a run killed
    (one restart) and preempted (exit 75); that launch again, which only finishes the interrupted run."""
    root = tmp_path_factory.mktemp("pp")
    token = f"mgtest-pp-{os.getpid()}-{time.monotonic_ns()}"  # the module's no_leftovers
    started = time.monotonic()
    try:
        stdout = {
            "pp2dp2": _train(
                root / "pp2dp2",
                4,
                token,
                "--pp",
                "2",
                "--batch",
                "4",
                *CLIP,
                "--runs",
                "ddp:1f1b,fsdp:1f1b,ddp:1f1b:accumulated:2",
            )
        }
        step3 = root / "single" / "continued" / "checkpoints" / "step-00000003"
        shutil.copytree(root / "pp2dp2" / "fsdp-1f1b" / "checkpoints" / step3.name, step3)
        stdout["single"] = _train(
            root / "single",
            1,
            token,
            "--batch",
            "8",
            *CLIP,
            "--runs",
            "single:-,fsdp:1f1b:continued",
        )
        pp2 = (
            root / "pp2",
            2,
            token,
            "--pp",
            "2",
            "--batch",
            "8",
            *CLIP,
            "--kill-at",
            "1",
            "--preempt-at",
            "4",
            "--runs",
            "ddp:gpipe,ddp:1f1b,ddp:interleaved_1f1b,ddp:1f1b:interrupted",
        )
        stdout["pp2"] = _train(*pp2, restarts=1, status=75)
        stdout["again"] = _train(*pp2)
        yield {"root": root, "stdout": stdout, "seconds": time.monotonic() - started}
    finally:
        left = wait_until_gone(token, timeout=15)
        kill_all(left)
        assert not left, f"processes left behind: {left}"


# on first use, four launches of 1 to 4 processes: ~2-4 min on 2 busy cores
@pytest.mark.timeout(900)
def test_pp2_equals_one_process_with_every_schedule(runs):
    single = _result(runs["root"] / "single" / "single")
    assert "(2 processes: pp 2 x dp 1)" in runs["stdout"]["pp2"]
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        assert f"done ddp:{schedule} strategy=pp+ddp world=2 dp=1 step=6" in runs["stdout"]["pp2"]
        difference = _max_difference(_result(runs["root"] / "pp2" / f"ddp-{schedule}"), single)
        print(f"pp 2, {schedule}: {difference:.1e} (launches: {runs['seconds']:.0f} s)")
        assert difference < TOLERANCE


@pytest.mark.timeout(900)  # shares the launches above
def test_pp2_x_dp2_with_ddp_and_with_fsdp_and_accumulating_equals_one_process(runs):
    single = _result(runs["root"] / "single" / "single")
    assert "(4 processes: pp 2 x dp 2)" in runs["stdout"]["pp2dp2"]
    for strategy in ("ddp", "fsdp"):
        assert (
            f"done {strategy}:1f1b strategy=pp+{strategy} world=4 dp=2 step=6"
            in runs["stdout"]["pp2dp2"]
        )
        difference = _max_difference(_result(runs["root"] / "pp2dp2" / f"{strategy}-1f1b"), single)
        print(f"pp 2 x dp 2, {strategy}: {difference:.1e}")
        assert difference < TOLERANCE
    # accumulation: gradients averaged over the stage's replicas only at the boundary (no_sync before it)
    accumulated = _result(runs["root"] / "pp2dp2" / "accumulated")
    assert len(accumulated["losses"]) == 12  # a loss per micro-step
    difference = _max_difference(accumulated, single, losses=False)
    print(f"pp 2 x dp 2, ddp, accumulate 2: {difference:.1e}")
    assert difference < TOLERANCE


@pytest.mark.timeout(900)  # shares the launches above
def test_a_pp2_x_dp2_checkpoint_continues_in_one_process_and_consolidates(runs, tmp_path):
    """Step 3 of the pp 2 x dp 2 fsdp run (DCP shards written per stage) continued by one plain fsdp
    process ends where the 4 processes ended; its last step consolidates to a plain state.pt."""
    source = _result(runs["root"] / "pp2dp2" / "fsdp-1f1b")
    assert "resumed from" in runs["stdout"]["single"] and "step 3)" in runs["stdout"]["single"]
    assert "done fsdp:1f1b:continued strategy=fsdp world=1 dp=1 step=6" in runs["stdout"]["single"]
    difference = _max_difference(
        _result(runs["root"] / "single" / "continued"), source, losses=False
    )
    print(f"pp 2 x dp 2 step 3 continued by 1 process: {difference:.1e}")
    assert difference < TOLERANCE
    plain = consolidate(
        runs["root"] / "pp2dp2" / "fsdp-1f1b" / "checkpoints" / "step-00000006", tmp_path
    )
    weights = torch.load(plain / "state.pt", weights_only=True)["model"]
    assert sorted(weights) == sorted(source["weights"])
    assert all(torch.equal(weights[k], source["weights"][k]) for k in weights)
    # the unsplit Sequential's names
    assert {k.split(".")[0] for k in weights} == {"0", "1", "2", "3", "4"}


@pytest.mark.timeout(900)  # shares the launches above
def test_pp2_killed_then_preempted_resumes_bitwise(runs):
    """Rank 1 (the last stage) is SIGKILLed after step 2, before its checkpoint: the agent restarts both,
    which resume from step 1. The last rank then gets SIGUSR1 at step 4: every rank stops at one step,
    checkpoints, exits 75. Launched again, the run ends bitwise where the uninterrupted run ended."""
    first, again = runs["stdout"]["pp2"], runs["stdout"]["again"]
    assert "resumed from" in first and "step 1)" in first and "multigpu: stopped by" in first
    assert (
        "resumed from" in again
        and "done ddp:1f1b:interrupted" in again
        and "done ddp:gpipe" not in again
    )
    final = _result(runs["root"] / "pp2" / "interrupted")["weights"]
    expected = _result(runs["root"] / "pp2" / "ddp-1f1b")["weights"]
    assert all(torch.equal(final[k], expected[k]) for k in expected)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 8 processes on 2 cores: ~1 min here
def test_3d_pp2_x_dp_shard2_x_tp2_equals_one_process(runs, no_leftovers):
    """pp 2 x dp_shard 2 x tp 2: FSDP2 and tensor parallelism inside each of two stages."""
    out = runs["root"] / "3d"
    stdout = _train(
        out,
        8,
        no_leftovers,
        "--pp",
        "2",
        "--tp",
        "2",
        "--batch",
        "4",
        *CLIP,
        "--runs",
        "fsdp+tp:1f1b",
    )
    assert "(8 processes: pp 2 x dp_shard 2 x tp 2)" in stdout
    assert "done fsdp+tp:1f1b strategy=pp+fsdp+tp world=8 dp=2 step=6" in stdout
    difference = _max_difference(
        _result(out / "fsdp+tp-1f1b"), _result(runs["root"] / "single" / "single")
    )
    print(f"pp 2 x dp_shard 2 x tp 2: {difference:.1e}")
    assert difference < TOLERANCE
