"""GPU checks (marker `gpu`): skipped where no CUDA GPU is visible, as on CI. Run them with
`pytest -m gpu` on a GPU machine; they use real NCCL and the same comparisons as the CPU tests."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, SCRIPTS, multigpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU visible (CI has none)")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_nccl_with_one_rank_and_eager_init():
    proc = multigpu("run", "--gpus", "0", str(SCRIPTS / "allreduce.py"), check=True)
    (record,) = _records(proc.stdout)
    assert record["world_size"] == 1 and record["sum"] == 1.0


@two_gpus
def test_nccl_two_ranks():
    proc = multigpu("run", "--gpus", "0,1", str(SCRIPTS / "allreduce.py"), check=True)
    assert sorted((r["rank"], r["backend"], r["sum"]) for r in _records(proc.stdout)) == [(0, "nccl", 3.0), (1, "nccl", 3.0)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_digits_mixed_precision_on_one_gpu(tmp_path, precision):
    multigpu("run", "--gpus", "0", str(REPO / "examples/digits/train.py"), str(REPO / "examples/digits/hparams.yaml"),
             f"trainer.precision={precision}", f"trainer.out_dir={tmp_path}", f"data.folder={tmp_path / 'd'}", check=True)
    assert json.loads((tmp_path / "final.json").read_text())["accuracy"] >= 0.95


@two_gpus
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpus_equal_one_gpu(tmp_path, strategy):
    common = ["--global-batch", "8", "--strategy", strategy]
    multigpu("run", "--gpus", "0,1", str(SCRIPTS / "equivalence.py"), str(tmp_path / "two.pt"), "--batch", "4", *common,
             check=True)
    multigpu("run", "--gpus", "0", str(SCRIPTS / "equivalence.py"), str(tmp_path / "one.pt"), "--batch", "8",
             "--global-batch", "8", check=True)
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("two", "one"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@two_gpus
def test_pipeline_across_two_gpus_equals_the_unsplit_model(tmp_path):
    multigpu("run", "--gpus", "0,1", "--gpus-per-proc", "2", str(SCRIPTS / "equivalence.py"), str(tmp_path / "p.pt"),
             "--batch", "8", "--global-batch", "8", "--strategy", "pipeline", check=True)
    multigpu("run", "--gpus", "0", str(SCRIPTS / "equivalence.py"), str(tmp_path / "one.pt"), "--batch", "8",
             "--global-batch", "8", check=True)
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("p", "one"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


def test_compiled_model_checkpoint_has_plain_names(tmp_path):
    import multigpu as mg
    from multigpu.strategies import clean_state_dict, unwrap_module

    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)).cuda())
    state = clean_state_dict(unwrap_module(model).state_dict())
    assert sorted(state) == ["0.bias", "0.weight"]
    assert mg.World().world_size == 1


@pytest.mark.parametrize("precision", ["32", "bf16", "fp16"])
def test_training_steps_make_no_host_synchronisation(tmp_path, precision):
    gpus = "0,1" if GPUS >= 2 else "0"
    multigpu("run", "--gpus", gpus, str(SCRIPTS / "no_sync.py"), str(tmp_path), "--precision", precision, check=True)
    assert int((tmp_path / "ok-rank0.txt").read_text()) >= 30
