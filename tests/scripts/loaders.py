"""Users' data through the Trainer: their DataLoader, an IterableDataset, Hugging Face datasets.

    multigpu run --nproc 2 loaders.py OUT MODE[,MODE...] [--kill-at STEP]

Each mode trains in turn in OUT/<mode>/ (one launch for several: a launch costs ~5 s, a mode well under
one), from scratch: the same seeds, a new model and Trainer.
MODE: dataset | dataloader   the same training from a Dataset and from a user's DataLoader (dict batches,
                             a collate function, a worker), final weights in OUT/<mode>/final.pt
      stream                 an IterableDataset of 101 ids read by 2 workers per rank: the ids trained on
                             and evaluated, per rank, in OUT/stream/seen-rank<r>.json
      hf-map | hf-stream     a datasets.Dataset / its streaming form, batched by a tokenizer-free collator
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import multigpu as mg
from multigpu.checkpoint.rng import seed_everything

root, modes = Path(sys.argv[1]), sys.argv[2].split(",")
kill_at = int(sys.argv[sys.argv.index("--kill-at") + 1]) if "--kill-at" in sys.argv else None
run = mg.init(seed=0, timeout_s=60)
g = torch.Generator().manual_seed(3)
X, Y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)


class Pairs(Dataset):
    def __len__(self):
        return len(X)

    def __getitem__(self, i):
        return {"x": X[i], "y": Y[i], "id": i}


def collate(items):
    return {
        "x": torch.stack([i["x"] for i in items]),
        "y": torch.stack([i["y"] for i in items]),
        "id": torch.tensor([i["id"] for i in items]),
    }


class Ids(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": X[i % len(X)], "y": Y[i % len(X)], "id": i}


class Fit(mg.Trainer):
    def compute_loss(self, batch):
        if (
            kill_at is not None
            and self.state.global_step == kill_at
            and run.rank == 1
            and run.world.restart_count == 0
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        self.seen.extend(batch["id"].tolist())
        return F.cross_entropy(self.model(batch["x"]), batch["y"])

    def evaluate_batch(self, batch):
        n = len(batch["y"])
        self.evaluated.extend(batch["id"].tolist())
        return {"loss": (F.cross_entropy(self.model(batch["x"]), batch["y"], reduction="sum"), n)}


def train(mode: str) -> None:
    out = root / mode
    seed_everything(0)  # as mg.init(seed=0) left a fresh process
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    common = dict(
        epochs=2,
        out_dir=str(out),
        progress=False,
        checkpoint_every_steps=1,
        keep_last=50,
        plot=False,
        log_every_n_steps=0,
    )
    trainer = Fit(
        run,
        model,
        lambda p: torch.optim.AdamW(p, lr=0.01),
        batch_size=8,
        collate_fn=collate,
        **common,
    )
    trainer.seen, trainer.evaluated = [], []
    if mode == "dataset":
        trainer.fit(Pairs())
    elif mode == "dataloader":
        trainer.fit(
            DataLoader(
                Pairs(),
                batch_size=8,
                shuffle=True,
                collate_fn=collate,
                num_workers=1,
                persistent_workers=True,
                drop_last=False,
            )
        )
    elif mode == "stream":
        trainer.settings.num_workers = 2
        trainer.fit(Ids(101), epochs=1)
        trainer.evaluate(Ids(101))
        (out / f"seen-rank{run.rank}.json").write_text(
            json.dumps(
                {
                    "train": trainer.seen,
                    "eval": trainer.evaluated,
                    "steps": trainer.state.global_step,
                }
            )
        )
    elif mode in ("hf-map", "hf-stream"):
        import datasets

        table = datasets.Dataset.from_dict(
            {"x": X.tolist(), "y": Y.tolist(), "id": list(range(len(X)))}
        )
        data = table if mode == "hf-map" else table.to_iterable_dataset(num_shards=4)

        def hf_collate(rows):
            return {
                "x": torch.tensor([r["x"] for r in rows]),
                "y": torch.tensor([r["y"] for r in rows]),
                "id": torch.tensor([r["id"] for r in rows]),
            }

        trainer.settings.collate_fn = hf_collate
        trainer.fit(data, epochs=1)
        trainer.evaluate(data)
        (out / f"seen-rank{run.rank}.json").write_text(
            json.dumps({"train": trainer.seen, "eval": trainer.evaluated})
        )
    if mode in ("dataset", "dataloader"):
        weights = run.state_dict(trainer.model)
        if run.is_main:
            torch.save(weights, out / "final.pt")
            print(f"done {mode} step {trainer.state.global_step}", flush=True)


for mode in modes:
    train(mode)
