"""Hugging Face's Trainer, written as its documentation writes it, unchanged under `multigpu run`.

A tiny GPT-2 built from a config (no download) on random tokens, so it runs anywhere in seconds:

    python train.py                         # one process
    multigpu run --nproc 2 train.py         # 2 processes: the Trainer reads the variables torchrun sets
    torchrun --nproc_per_node=2 train.py    # the same

It does not import multigpu: the launcher is all it takes (docs/migrating.md).
"""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, length: int = 16, vocab: int = 64) -> None:
        self.tokens = torch.randint(
            0, vocab, (n, length), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main(out_dir: str) -> None:
    # before the model is built, as run_clm.py does: the same weights in every process and run
    set_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    )
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=8,
        max_steps=20,
        learning_rate=1e-3,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(
            f"final train_loss {result.training_loss:.4f} after {result.global_step} steps "
            f"on {args.world_size} process(es)"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "outputs/hf_trainer")
