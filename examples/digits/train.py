"""Handwritten-digit classifier (scikit-learn's bundled 8x8 digits: no download) - the reference recipe.

Run it any of these ways; the script does not change:

    multigpu run --nproc 2 examples/digits/train.py examples/digits/hparams.yaml      # 2 CPU processes
    multigpu run examples/digits/train.py examples/digits/hparams.yaml               # every GPU
    multigpu run --gpus 0,2 examples/digits/train.py examples/digits/hparams.yaml trainer.epochs=5
    torchrun --nproc_per_node=2 examples/digits/train.py examples/digits/hparams.yaml
    python examples/digits/train.py examples/digits/hparams.yaml                     # one process

    multigpu queue examples/digits/runs.yaml                                         # a family of runs

Settings come from hparams.yaml, then KEY=VALUE overrides (dotted for nested keys). The batch size is
per process. Outputs (metrics.csv, checkpoints/, config.yaml, final.json) go to ``trainer.out_dir``;
running the same command again resumes from the last checkpoint. The recipe has three stages,
prepare -> train -> evaluate; ``start_stage=evaluate`` re-evaluates the last checkpoint without training.
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu import config


@dataclass
class ModelConfig:
    hidden: int = 128
    depth: int = 2
    dropout: float = 0.0


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 1e-4
    schedule: str = "cosine"  # or "constant"


@dataclass
class DataConfig:
    folder: str = "outputs/digits-data"
    valid_fraction: float = 0.2
    split_seed: int = 0


@dataclass
class DigitsConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: mg.TrainerSettings = field(default_factory=mg.TrainerSettings)
    start_stage: Optional[str] = None  # prepare, train or evaluate (or 0, 1, 2, counted as in ASDF)
    end_stage: Optional[str] = None


STAGES = ("prepare", "train", "evaluate")


def prepare_data(cfg: DataConfig) -> str:
    """Split the digits once and save them as tensors (run on rank 0 only, via run_on_main). A folder that
    holds this split already is used as it is, as SpeechBrain's recipes skip a finished data preparation:
    runs of a queue, trials of a sweep and resumed runs share it (and skip scikit-learn's import, seconds)."""
    path = Path(cfg.folder) / f"digits-{cfg.split_seed}-{cfg.valid_fraction}.pt"
    if path.is_file() and not path.is_symlink():  # a link or a pipe of that name is replaced, never read
        return str(path)
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(cfg.split_seed))
    n_valid = int(len(x) * cfg.valid_fraction)
    valid, train = order[:n_valid], order[n_valid:]
    data = io.BytesIO()
    torch.save({"train": (x[train], y[train]), "valid": (x[valid], y[valid])}, data)
    # whole, or not at all (several runs of a queue may prepare at once), never through a link at its place
    return str(mg.write_file(path, data.getvalue()))


def make_model(cfg: ModelConfig) -> nn.Module:
    layers: list[nn.Module] = []
    width = 64
    for _ in range(cfg.depth):
        layers += [nn.Linear(width, cfg.hidden), nn.GELU(), nn.Dropout(cfg.dropout)]
        width = cfg.hidden
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


class DigitsTrainer(mg.Trainer):
    def compute_loss(self, batch):
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)

    def evaluate_batch(self, batch):
        images, labels = batch
        logits = self.model(images)
        n = len(labels)
        return {
            "loss": (F.cross_entropy(logits, labels, reduction="sum"), n),
            "accuracy": ((logits.argmax(dim=1) == labels).sum(), n),
        }


def main(argv: list[str]) -> Optional[dict]:
    yaml_path = argv[0] if argv and argv[0].endswith((".yaml", ".yml")) else None
    cfg = config.load(DigitsConfig, yaml_path, argv[1:] if yaml_path else argv)
    stages = mg.Stages(STAGES, cfg.start_stage, cfg.end_stage)
    run = mg.init(seed=cfg.trainer.seed)

    if "prepare" in stages:
        mg.run_on_main(prepare_data, cfg.data)  # once, on rank 0; the other ranks wait
    data_file = Path(cfg.data.folder) / f"digits-{cfg.data.split_seed}-{cfg.data.valid_fraction}.pt"
    if not data_file.is_file() or data_file.is_symlink():  # a pipe or a link of that name is not read
        raise mg.MultiGPUError(f"{data_file} does not exist (or is not a plain file).",
                               "run the prepare stage first (start_stage=prepare).")
    try:
        tensors = torch.load(data_file, weights_only=True)
        train_set, valid_set = TensorDataset(*tensors["train"]), TensorDataset(*tensors["valid"])
    except Exception as exc:  # not what prepare_data writes: say so in one line
        raise mg.MultiGPUError(f"{data_file} is not a split of the digits ({type(exc).__name__}).",
                               "delete it: the prepare stage writes it again.") from None

    settings = cfg.trainer
    steps = settings.epochs * -(-len(train_set) // (settings.batch_size * run.world_size * settings.accumulate))

    def schedule(optimizer):
        if cfg.optim.schedule == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)

    trainer = DigitsTrainer(
        run,
        make_model(cfg.model),
        lambda params: torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay),
        scheduler=schedule,
        settings=settings,
        config=cfg,  # ranks compare it before training: a different hparams file on one node fails fast
    )
    if run.is_main:  # mg.write_file: a link planted in a run folder someone handed you is replaced, not followed
        mg.write_file(Path(settings.out_dir) / "config.yaml", config.dump_yaml(cfg))
    if "train" in stages:
        trainer.fit(train_set, valid_set)
    if "evaluate" not in stages:
        return None
    if "train" not in stages and not trainer.resume():
        raise mg.MultiGPUError(f"no checkpoint in {trainer.checkpoint_dir} to evaluate.", "run the train stage first.")
    final = trainer.evaluate(valid_set)
    run.print(f"final validation accuracy: {final['accuracy']:.4f} (loss {final['loss']:.4f}, "
              f"{run.world_size} process(es))")
    if run.is_main:
        mg.write_file(Path(settings.out_dir) / "final.json", json.dumps(final))
    return final


if __name__ == "__main__":
    main(sys.argv[1:])
