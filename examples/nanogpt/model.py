"""A small GPT with nanoGPT's interface: ``GPT(GPTConfig(...))``, ``model(idx, targets) -> (logits, loss)``,
``configure_optimizers(...)`` and ``generate(...)``. Written for this example (a decoder-only transformer
as in GPT-2); nothing in it knows about multigpu.

One detail matters for ``multigpu check``: the attention's dropout probability is read from an
``nn.Dropout`` module, not from a float, so that the check - which sets every ``nn.Dropout``'s ``p``
to 0 in both of its runs - switches it off too. A float passed to ``F.scaled_dot_product_attention``
would stay on, and the runs would differ by their dropout masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with one fused q/k/v projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.out = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # its p is what the attention uses (see the module docstring)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.out_drop = nn.Dropout(cfg.dropout)
        self.heads = cfg.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(x).split(c, dim=2)
        )
        p = self.attn_drop.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.out_drop(self.out(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = SelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.positions = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # tied input and output embeddings, as in GPT-2
        self.apply(self._init)
        # GPT-2's scaled init of the residual projections
        for name, param in self.named_parameters():
            if name.endswith("attn.out.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(
                f"a sequence of {t} tokens is longer than block_size {self.config.block_size}"
            )
        x = self.drop(self.tokens(idx) + self.positions(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if targets is None:  # generation: only the last position's logits are needed
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(
        self,
        weight_decay: float,
        learning_rate: float,
        betas: tuple[float, float],
        device_type: str,
    ) -> torch.optim.AdamW:
        """AdamW with weight decay on matrices only (not on biases, norms or 1-d parameters)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0
    ) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx
