r"""A small GPT on characters (minGPT-like), trained on the Python documentation that ships with Python
(``pydoc_data.topics``: ~465k characters of English and code, no download).

The model is an ``nn.Sequential`` of embedding, transformer blocks and head, so every strategy applies;
switch with one setting:

    multigpu run --nproc 2 examples/char_gpt/train.py examples/char_gpt/hparams.yaml                         # ddp
    multigpu run --nproc 2 examples/char_gpt/train.py examples/char_gpt/hparams.yaml trainer.strategy=fsdp
    multigpu run examples/char_gpt/train.py examples/char_gpt/hparams.yaml trainer.strategy=pipeline         # 2 stages
    multigpu run --gpus-per-proc 2 examples/char_gpt/train.py examples/char_gpt/hparams.yaml trainer.strategy=ddp+pipeline
    multigpu run --gpus 0 examples/char_gpt/train.py examples/char_gpt/hparams.yaml trainer.precision=bf16
    multigpu run --nproc 4 examples/char_gpt/train.py examples/char_gpt/hparams.yaml trainer.strategy=fsdp+tp trainer.tp=2
    multigpu run --nproc 4 examples/char_gpt/train.py examples/char_gpt/hparams.yaml trainer.strategy=hsdp trainer.dp_replicate=2
    multigpu run --nproc 2 examples/char_gpt/train.py examples/char_gpt/hparams.yaml trainer.pp=2  # 2 stages, 2 processes
    multigpu run --nproc 4 examples/char_gpt/train.py examples/char_gpt/hparams.yaml trainer.pp=2 trainer.strategy=fsdp \
        trainer.pipeline_schedule=interleaved_1f1b

At the end rank 0 prints a sample of generated text and the training throughput in tokens/s.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import multigpu as mg
from multigpu import config


@dataclass
class ModelConfig:
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


@dataclass
class OptimConfig:
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20


@dataclass
class DataConfig:
    stride: int = 32  # characters between the starts of two training windows
    valid_fraction: float = 0.05


@dataclass
class GPTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: mg.TrainerSettings = field(default_factory=mg.TrainerSettings)
    sample_chars: int = 300


def load_text() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


class Windows(Dataset):
    """Overlapping windows of ``block_size + 1`` characters: inputs and next-character targets."""

    def __init__(self, ids: torch.Tensor, block_size: int, stride: int) -> None:
        self.ids, self.block_size = ids, block_size
        self.starts = range(0, len(ids) - block_size - 1, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int):
        start = self.starts[index]
        chunk = self.ids[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class Embed(nn.Module):
    def __init__(self, vocab: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, cfg.n_embd)
        self.positions = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tokens(idx) + self.positions(positions))


class Block(nn.Module):
    """Pre-norm attention and MLP. Written for tensor parallelism too: with ``fsdp+tp`` the q/k/v and
    first MLP layers are split by output features and proj/second MLP layer by input features, so a
    rank sees ``n_head / tp`` heads - the forward infers that from the width it gets, not from cfg."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        # a key bias shifts every score equally: no effect
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )
        self.head_dim, self.dropout = cfg.n_embd // cfg.n_head, cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        # all heads, or this rank's share under tensor parallelism
        heads = q.shape[-1] // self.head_dim
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))
        return x + self.mlp(self.ln2(x))


#: Which layers tensor parallelism splits (Megatron's pairs), by module name in the Sequential below.
TP_PLAN = {
    "*.q": "colwise",
    "*.k": "colwise",
    "*.v": "colwise",
    "*.proj": "rowwise",
    "*.mlp.0": "colwise",
    "*.mlp.2": "rowwise",
}


def make_gpt(vocab: int, cfg: ModelConfig) -> nn.Sequential:
    """Embedding, blocks, head - a Sequential, so ``pipeline`` can split it and ``fsdp`` finds the blocks;
    ``tp_plan`` tells ``fsdp+tp`` which layers to split."""
    model = nn.Sequential(
        Embed(vocab, cfg),
        *(Block(cfg) for _ in range(cfg.n_layer)),
        nn.LayerNorm(cfg.n_embd),
        nn.Linear(cfg.n_embd, vocab),
    )
    model.tp_plan = TP_PLAN
    return model


class GPTTrainer(mg.Trainer):
    def compute_loss(self, batch):
        inputs, targets = batch
        logits = self.model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate_batch(self, batch):
        inputs, targets = batch
        logits = self.model(inputs)
        n = targets.numel()
        return {
            "loss": (
                F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
                ),
                n,
            )
        }


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, steps: int, block_size: int) -> torch.Tensor:
    idx = prompt
    for _ in range(steps):
        logits = model(idx[:, -block_size:])[:, -1]
        idx = torch.cat(
            [idx, torch.multinomial(F.softmax(logits.float(), dim=-1), 1).to(idx.device)], dim=1
        )
    return idx


def main(argv: list[str]) -> None:
    yaml_path = argv[0] if argv and argv[0].endswith((".yaml", ".yml")) else None
    cfg = config.load(GPTConfig, yaml_path, argv[1:] if yaml_path else argv)
    run = mg.init(seed=cfg.trainer.seed)
    text = load_text()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    cut = int(len(ids) * (1 - cfg.data.valid_fraction))
    train_set = Windows(ids[:cut], cfg.model.block_size, cfg.data.stride)
    valid_set = Windows(ids[cut:], cfg.model.block_size, cfg.model.block_size)

    model = make_gpt(len(chars), cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    run.print(
        f"char_gpt: {n_params / 1e6:.2f}M parameters, vocabulary {len(chars)}, strategy {cfg.trainer.strategy}"
    )
    settings = cfg.trainer
    # tensor-parallel ranks and pipeline stages share a batch
    data_ranks = run.world_size // (settings.tp * settings.pp)
    total_steps = settings.max_steps or settings.epochs * math.ceil(
        len(train_set) / (settings.batch_size * data_ranks)
    )

    def schedule(optimizer):
        warmup = max(cfg.optim.warmup_steps, 1)
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: (
                min(1.0, (s + 1) / warmup)
                * 0.5
                * (1 + math.cos(math.pi * min(s / max(total_steps, 1), 1.0)))
            ),
        )

    trainer = GPTTrainer(
        run,
        model,
        lambda p: torch.optim.AdamW(
            p, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, betas=(0.9, 0.95)
        ),
        scheduler=schedule,
        settings=settings,
        config=cfg,
    )
    started = time.perf_counter()
    history = trainer.fit(train_set, valid_set)
    elapsed = time.perf_counter() - started
    epochs = [row for row in history if "epoch_s" in row]  # not the rows of eval_every_steps
    if epochs:
        tokens = sum(row["samples_per_s"] * row["epoch_s"] for row in epochs) * cfg.model.block_size
        run.print(
            f"char_gpt: {tokens / max(sum(r['epoch_s'] for r in epochs), 1e-9):,.0f} tokens/s in training "
            f"({elapsed:.0f} s with evaluation and checkpoints)"
        )
    if cfg.sample_chars and trainer.strategy.name in ("single", "ddp"):
        plain = trainer.strategy.unwrap(trainer.model).eval()
        prompt = ids[cut : cut + 16].unsqueeze(0).to(run.device)
        out = generate(plain, prompt, cfg.sample_chars, cfg.model.block_size)[0].tolist()
        run.print("char_gpt sample:\n" + "".join(chars[i] for i in out))


if __name__ == "__main__":
    main(sys.argv[1:])
