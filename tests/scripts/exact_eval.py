"""Evaluate a fixed model on 101 samples with any number of ranks; save the global metrics.

    multigpu run --nproc 3 exact_eval.py OUT.json [OUT.json:STRATEGY ...]

Each OUT.json (the strategy after a colon, default auto) is one evaluation of a freshly built model.
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

run = mg.init(seed=0, timeout_s=60)
generator = torch.Generator().manual_seed(3)
x = torch.randn(101, 5, generator=generator)
y = torch.randint(0, 4, (101,), generator=generator)


class Eval(mg.Trainer):
    def compute_loss(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)

    def evaluate_batch(self, batch):
        inputs, labels = batch
        logits = self.model(inputs)
        return {
            "accuracy": ((logits.argmax(1) == labels).sum(), len(labels)),
            "loss": (F.cross_entropy(logits, labels, reduction="sum"), len(labels)),
        }


def evaluate(path: str, strategy: str) -> None:
    """One evaluation: a fresh model (FSDP shards it in place), the Trainer's metrics and the helpers'."""
    torch.manual_seed(11)
    model = nn.Linear(5, 4)
    trainer = Eval(
        run,
        model,
        lambda p: torch.optim.SGD(p, lr=0.1),
        batch_size=8,
        eval_batch_size=5,
        resume=False,
        progress=False,
        out_dir=path + ".run",
        strategy=strategy,
    )
    metrics = trainer.evaluate(TensorDataset(x, y))

    # The same through the bring-your-own-loop helpers, plus per-sample predictions in dataset order.
    loader = run.eval_loader(TensorDataset(x, y), batch_size=7)
    correct, seen, predictions = 0, 0, []
    plain = run.unwrap(trainer.model) if strategy != "fsdp" else trainer.model
    with torch.no_grad():
        for inputs, labels in loader:
            logits = plain(inputs)
            correct += int((logits.argmax(1) == labels).sum())
            seen += len(labels)
            predictions.append(logits.argmax(1))
    byo = run.reduce({"accuracy": (correct, seen)})
    ordered = run.gather_in_order(torch.cat(predictions))
    if run.is_main:
        with open(path, "w") as handle:
            json.dump(
                {
                    "trainer": metrics,
                    "byo": byo,
                    "predictions": ordered.tolist(),
                    "local_seen": seen,
                },
                handle,
            )


for item in sys.argv[1:]:
    out, _, name = item.partition(":")
    evaluate(out, name or "auto")
