"""Where CUDA changes what the library does; prints one JSON record per check and rank.

    multigpu run --gpus 0 gpu_paths.py CHECK[,CHECK...] OUT

CHECK: init | pinned | precision | fsdp_dcp | compile. On a CPU machine the same code runs on the CPU
(the CUDA-only facts are then reported as such, not faked), so the script itself is exercised by the CPU
tier; tests/test_gpu.py asserts the CUDA values on a GPU.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.checkpoint import files
from multigpu.trainer import move_to
from multigpu.trainer.precision import Precision

checks, out = sys.argv[1].split(","), Path(sys.argv[2])
run = mg.init(seed=0, timeout_s=120)
g = torch.Generator().manual_seed(3)
x = torch.randn(256, 16, generator=g)
y = (x[:, :4].sum(dim=1) > 0).long()
data = TensorDataset(x, y)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 2))


class Classifier(mg.Trainer):
    def compute_loss(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)


def check_record(check: str) -> dict:
    """One check on every rank: this rank's record."""
    record: dict = {
        "check": check,
        "rank": run.rank,
        "device": str(run.device),
        "world_size": run.world_size,
    }
    if check == "init":
        # The device and backend mg.init picked, and a collective on the chosen device.
        value = torch.ones(1, device=run.device) * (run.rank + 1)
        if run.world_size > 1:
            torch.distributed.all_reduce(value)
        record.update(
            backend=run.backend,
            sum=value.item(),
            current=torch.cuda.current_device() if run.device.type == "cuda" else None,
        )

    elif check == "pinned":
        # The loader pins host memory for a GPU, and batches move without blocking the host.
        loader = run.loader(data, batch_size=32)
        inputs, labels = next(iter(loader))
        moved = move_to((inputs, labels), run.device)
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        record.update(
            pinned=inputs.is_pinned(),
            moved_to=str(moved[0].device),
            same=bool(torch.equal(moved[0].cpu(), inputs) and torch.equal(moved[1].cpu(), labels)),
        )

    elif check == "precision":
        # bf16 and fp16 autocast give half-precision matmuls; fp16's scaler skips a step with inf gradients.
        layer = nn.Linear(16, 16).to(run.device)
        dtypes = {}
        for mode in ("bf16", "fp16"):
            with Precision(mode, run.device).autocast():
                dtypes[mode] = str(layer(x[:4].to(run.device)).dtype)
        precision = Precision("fp16", run.device)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        before = layer.weight.detach().clone()
        with precision.autocast():
            loss = layer(x[:4].to(run.device)).float().sum() * float("inf")
        precision.scale(loss).backward()
        precision.step(optimizer)
        skipped = bool(torch.equal(before, layer.weight.detach()))
        scale = (
            precision.scaler.get_scale()
            if precision.scaler is not None and precision.scaler.is_enabled()
            else None
        )
        record.update(dtypes=dtypes, inf_step_skipped=skipped, scale_after=scale)

    elif check == "fsdp_dcp":
        # FSDP2 with bf16 autocast; its DCP checkpoint resumes into a fresh Trainer bit for bit.
        common = dict(
            strategy="fsdp",
            precision="bf16",
            batch_size=32,
            out_dir=str(out / "run"),
            progress=False,
            plot=False,
            log_every_n_steps=0,
        )
        first = Classifier(
            run, model(), lambda p: torch.optim.AdamW(p, lr=1e-2), epochs=1, **common
        )
        first.fit(data)
        # rank 0's; {} elsewhere
        trained = {k: v.float() for k, v in run.state_dict(first.state_model).items()}
        second = Classifier(
            run, model(), lambda p: torch.optim.AdamW(p, lr=1e-2), epochs=1, **common
        )
        resumed = second.resume()
        loaded = {k: v.float() for k, v in run.state_dict(second.state_model).items()}
        latest = files.list_checkpoints(out / "run" / "checkpoints")[0].path
        record.update(
            resumed=resumed,
            equal=trained.keys() == loaded.keys()
            and all(torch.equal(trained[k], loaded[k]) for k in trained),
            sharded=(latest / ".metadata").exists(),
            checkpoint=str(latest),
            param_device=str(next(second.state_model.parameters()).device),
        )

    elif check == "compile":
        # torch.compile through the Trainer: trains, and checkpoints keep the model's own parameter names.
        trainer = Classifier(
            run,
            model(),
            lambda p: torch.optim.AdamW(p, lr=1e-2),
            epochs=3,
            batch_size=32,
            compile=True,
            out_dir=str(out / "run"),
            progress=False,
            plot=False,
            log_every_n_steps=0,
        )
        history = trainer.fit(data, data)
        latest = files.list_checkpoints(out / "run" / "checkpoints")[0].path
        record.update(
            losses=[round(h["train_loss"], 4) for h in history],
            checkpoint=str(latest),
            compiled=type(trainer.model).__name__,
        )
    else:
        sys.exit(f"unknown check {check!r}")
    return record


for check in checks:
    sys.stdout.write(json.dumps(check_record(check)) + "\n")
    sys.stdout.flush()
