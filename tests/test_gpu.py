"""GPU checks (marker `gpu`): skipped where no CUDA GPU is visible, as on CI. Run them with
`bash .ci/gpu-check` (or `pytest -m gpu`) on a GPU machine; they use real NCCL and the same comparisons
as the CPU tests. On a one-GPU machine the multi-process CUDA path runs as two processes sharing the
GPU (``--procs-per-gpu 2``, gloo over CUDA tensors: NCCL refuses two ranks on one GPU)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import PY, REPO, SCRIPTS, child_env, multigpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU visible (CI has none)"),
]
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
    assert sorted((r["rank"], r["backend"], r["sum"]) for r in _records(proc.stdout)) == [
        (0, "nccl", 3.0),
        (1, "nccl", 3.0),
    ]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_digits_mixed_precision_on_one_gpu(tmp_path, precision):
    multigpu(
        "run",
        "--gpus",
        "0",
        str(REPO / "examples/digits/train.py"),
        str(REPO / "examples/digits/hparams.yaml"),
        f"trainer.precision={precision}",
        f"trainer.out_dir={tmp_path}",
        f"data.folder={tmp_path / 'd'}",
        check=True,
    )
    assert json.loads((tmp_path / "final.json").read_text())["accuracy"] >= 0.95


@two_gpus
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpus_equal_one_gpu(tmp_path, strategy):
    common = ["--global-batch", "8", "--strategy", strategy]
    multigpu(
        "run",
        "--gpus",
        "0,1",
        str(SCRIPTS / "equivalence.py"),
        str(tmp_path / "two.pt"),
        "--batch",
        "4",
        *common,
        check=True,
    )
    multigpu(
        "run",
        "--gpus",
        "0",
        str(SCRIPTS / "equivalence.py"),
        str(tmp_path / "one.pt"),
        "--batch",
        "8",
        "--global-batch",
        "8",
        check=True,
    )
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("two", "one"))
    assert max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"]) < 1e-5


@two_gpus
def test_pipeline_across_two_gpus_equals_the_unsplit_model(tmp_path):
    multigpu(
        "run",
        "--gpus",
        "0,1",
        "--gpus-per-proc",
        "2",
        str(SCRIPTS / "equivalence.py"),
        str(tmp_path / "p.pt"),
        "--batch",
        "8",
        "--global-batch",
        "8",
        "--strategy",
        "pipeline",
        check=True,
    )
    multigpu(
        "run",
        "--gpus",
        "0",
        str(SCRIPTS / "equivalence.py"),
        str(tmp_path / "one.pt"),
        "--batch",
        "8",
        "--global-batch",
        "8",
        check=True,
    )
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("p", "one"))
    assert max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"]) < 1e-4


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
    multigpu(
        "run",
        "--gpus",
        gpus,
        str(SCRIPTS / "no_sync.py"),
        str(tmp_path),
        "--precision",
        precision,
        check=True,
    )
    assert int((tmp_path / "ok-rank0.txt").read_text()) >= 30


# ------------------------------------------------------------ where CUDA changes behaviour, one GPU


def _paths(check: str, out: Path, *launch: str) -> list[dict]:
    proc = multigpu(
        "run",
        *(launch or ("--gpus", "0")),
        str(SCRIPTS / "gpu_paths.py"),
        check,
        str(out),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return sorted(_records(proc.stdout), key=lambda r: r["rank"])


def test_init_picks_the_gpu_and_nccl(tmp_path):
    (record,) = _paths("init", tmp_path)
    assert (record["device"], record["current"], record["sum"]) == ("cuda:0", 0, 1.0)
    assert record["backend"] == "nccl"


def test_two_processes_share_one_gpu_over_gloo(tmp_path):
    records = _paths("init", tmp_path, "--gpus", "0", "--procs-per-gpu", "2")
    assert [(r["device"], r["backend"], r["sum"]) for r in records] == [("cuda:0", "gloo", 3.0)] * 2


def test_batches_are_pinned_and_reach_the_gpu(tmp_path):
    (record,) = _paths("pinned", tmp_path)
    assert record["pinned"] is True and record["moved_to"] == "cuda:0" and record["same"] is True


def test_bf16_and_fp16_autocast_and_the_fp16_scaler_skips_an_inf_step(tmp_path):
    (record,) = _paths("precision", tmp_path)
    assert record["dtypes"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}
    assert record["inf_step_skipped"] is True and record["scale_after"] == 32768.0  # 65536 halved


@pytest.mark.parametrize(
    "launch", [("--gpus", "0"), ("--gpus", "0", "--procs-per-gpu", "2")], ids=["one", "two-shared"]
)
def test_fsdp_bf16_dcp_checkpoint_resumes_exactly_and_loads_on_a_cpu_machine(tmp_path, launch):
    records = _paths("fsdp_dcp", tmp_path, *launch)
    assert all(r["resumed"] and r["sharded"] for r in records) and records[0]["equal"] is True
    assert records[0]["param_device"] == "cuda:0"
    # Saved on the GPU, read where no GPU is visible: verified, consolidated, loaded on the CPU.
    cpu = {"CUDA_VISIBLE_DEVICES": ""}
    checkpoint = records[0]["checkpoint"]
    assert multigpu("checkpoint", "verify", checkpoint, env=cpu).returncode == 0
    consolidated = multigpu(
        "checkpoint", "consolidate", checkpoint, "--out", str(tmp_path / "full"), env=cpu
    )
    assert consolidated.returncode == 0, consolidated.stderr
    code = (
        "import sys, torch; from multigpu.checkpoint import files; from pathlib import Path; "
        "p = next(Path(sys.argv[1]).glob('step-*')); s = files.load_state(p); "
        "assert all(t.device.type == 'cpu' for t in s['model'].values()); print(sorted(s['model']))"
    )
    loaded = subprocess.run(
        [PY, "-c", code, str(tmp_path / "full")],
        env=child_env(cpu),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert "0.weight" in loaded.stdout


def test_compile_through_the_trainer_trains_and_checkpoints_plain_names(tmp_path):
    (record,) = _paths("compile", tmp_path)
    assert record["compiled"] == "OptimizedModule" and record["losses"][-1] < record["losses"][0]
    from multigpu.checkpoint import files

    state = files.load_state(Path(record["checkpoint"]), map_location="cpu")
    assert sorted(state["model"]) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    assert all(t.device.type == "cpu" for t in state["model"].values())


def _faults(out: Path, *extra: str, launch: tuple = ("--gpus", "0")):
    return multigpu("run", *launch, str(SCRIPTS / "faults.py"), str(out), *extra, timeout=300)


@pytest.mark.parametrize(
    "launch, kill_rank",
    [(("--gpus", "0"), "0"), (("--gpus", "0", "--procs-per-gpu", "2"), "1")],
    ids=["one", "two-shared"],
)
def test_kill_and_resume_on_the_gpu_is_bitwise_equal(tmp_path, launch, kill_rank):
    """Dropout draws from the CUDA generator: the checkpoint must carry its state for an exact resume."""
    assert _faults(tmp_path / "ref", launch=launch).returncode == 0
    killed = _faults(tmp_path / "k", "--kill-at", "5", "--kill-rank", kill_rank, launch=launch)
    assert killed.returncode != 0
    resumed = _faults(tmp_path / "k", "--kill-at", "5", "--kill-rank", kill_rank, launch=launch)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = (torch.load(tmp_path / n / "final.pt", weights_only=True) for n in ("ref", "k"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------- two processes on one GPU against one process


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_on_one_gpu_equal_one_process(tmp_path, strategy):
    multigpu(
        "run",
        "--gpus",
        "0",
        "--procs-per-gpu",
        "2",
        str(SCRIPTS / "equivalence.py"),
        str(tmp_path / "two.pt"),
        "--batch",
        "4",
        "--global-batch",
        "8",
        "--strategy",
        strategy,
        check=True,
        timeout=300,
    )
    multigpu(
        "run",
        "--gpus",
        "0",
        str(SCRIPTS / "equivalence.py"),
        str(tmp_path / "one.pt"),
        "--batch",
        "8",
        "--global-batch",
        "8",
        check=True,
        timeout=300,
    )
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("two", "one"))
    assert max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"]) < 1e-5


def test_check_on_one_gpu_with_two_processes_sharing_it():
    proc = multigpu(
        "check",
        "--nproc",
        "2",
        "--procs-per-gpu",
        "2",
        "--steps",
        "4",
        str(SCRIPTS / "check_target.py"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# ------------------------------------------------------------------- runs packed on one GPU


def test_packed_runs_share_the_gpu_and_one_that_does_not_fit_fails_alone(tmp_path):
    script = SCRIPTS / "gpu_memory.py"
    runs = tmp_path / "runs.yaml"
    runs.write_text(
        f"small:\n  script: {script}\n  args: ['0.1']\n  out_dir_key: out_dir\n"
        f"too_big:\n  script: {script}\n  args: ['0.8']\n  out_dir_key: out_dir\n"
    )
    proc = multigpu(
        "queue",
        str(runs),
        "--gpus",
        "0",
        "--runs-per-gpu",
        "2",
        "--out",
        str(tmp_path / "q"),
        "--no-live",
        timeout=300,
    )
    assert proc.returncode == 1
    status = {
        n: json.loads((tmp_path / "q" / n / "status.json").read_text())
        for n in ("small", "too_big")
    }
    assert status["small"]["state"] == "done" and status["too_big"]["state"] == "failed"
    log = (tmp_path / "q" / "too_big" / "log.txt").read_text()
    assert (
        "out of GPU memory in a packed queue run, which may use 0.5 of the GPU" in log
        and "HINT" in log
    )
