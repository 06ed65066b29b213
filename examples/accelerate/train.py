"""A script in the shape of Hugging Face Accelerate's quick tour, unchanged under `multigpu run`.

    python train.py                                    # one process
    multigpu run --nproc 2 train.py                    # was: accelerate launch --num_processes 2 train.py
    multigpu run --nproc 2 train.py --mixed_precision bf16   # the script's own flag, read by its Accelerator

It does not import multigpu: Accelerator() reads the variables the launcher sets, as under torchrun
(docs/migrating.md).
"""

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixed_precision", default="no", choices=("no", "bf16", "fp16"))
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available()
    )
    set_seed(0)
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    inputs = torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(data, batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(args.epochs):
        model.train()
        for features, labels in loader:
            loss = nn.functional.cross_entropy(model(features), labels)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
        total = accelerator.gather_for_metrics(loss.detach().reshape(1)).mean()
        accelerator.print(
            f"epoch {epoch + 1}: loss {total.item():.4f} on {accelerator.num_processes} process(es)"
        )
    accelerator.end_training()


if __name__ == "__main__":
    main()
