"""The README's script: a whole multigpu recipe in one file (this folder's train.py, hparams.yaml, runs.yaml
are the files the README's commands name).

    python train.py hparams.yaml                   # one process (CPU or one GPU)
    multigpu run --nproc 2 train.py hparams.yaml   # 2 processes: the same result as one with the 2x batch
    multigpu run train.py hparams.yaml trainer.epochs=5 model.hidden=128   # KEY=VALUE overrides
"""

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu import config


@dataclass
class ModelConfig:
    hidden: int = 64


# hparams.yaml and KEY=VALUE overrides fill this in; a typo is an error naming file:line
@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    lr: float = 3e-3
    # epochs, batch_size, strategy, ...
    trainer: mg.TrainerSettings = field(default_factory=mg.TrainerSettings)


class Classifier(mg.Trainer):
    def compute_loss(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)

    def evaluate_batch(self, batch):  # sums and counts: exact over any number of processes
        inputs, labels = batch
        logits = self.model(inputs)
        return {
            "loss": (F.cross_entropy(logits, labels, reduction="sum"), len(labels)),
            "accuracy": ((logits.argmax(dim=1) == labels).sum(), len(labels)),
        }


def make_data(n: int, seed: int) -> TensorDataset:
    """Points in 16 dimensions labelled by a fixed random teacher: no download, the same on every rank."""
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    inputs = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def main(argv: list[str]) -> None:
    yaml_file = argv[0] if argv and argv[0].endswith((".yaml", ".yml")) else None
    cfg = config.load(Recipe, yaml_file, argv[1:] if yaml_file else argv)
    # torchrun / Slurm / multigpu run / plain python: found, not configured
    run = mg.init(seed=cfg.trainer.seed)
    model = nn.Sequential(
        nn.Linear(16, cfg.model.hidden), nn.GELU(), nn.Linear(cfg.model.hidden, 4)
    )
    trainer = Classifier(
        run,
        model,
        lambda params: torch.optim.AdamW(params, lr=cfg.lr),
        # strategy: ddp on several processes (trainer.strategy)
        settings=cfg.trainer,
        config=cfg,
    )
    # resumes by itself from the last good checkpoint
    trainer.fit(make_data(1024, seed=1), make_data(256, seed=2))
    final = trainer.evaluate(make_data(256, seed=2))
    run.print(f"validation accuracy {final['accuracy']:.3f} on {run.world_size} process(es)")


if __name__ == "__main__":
    main(sys.argv[1:])
