"""The GPT the check trains: a small own module, so nothing is downloaded and every engine
(partita, plain torch, FSDP2, DeepSpeed) sees the same parameters in the same order.

Blocks sit in one ``nn.ModuleList``: partita's stage 3 makes each a unit, FSDP2 gets
``fully_shard`` per block. The head is tied to the token embedding (GPT-2's layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Shape:
    """A model and batch shape: vocabulary, width, depth, heads, sequence, micro-batch."""

    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    micro: int
    dropout: float = 0.0
    sdpa: bool = False
    """Attention through ``scaled_dot_product_attention`` (flash kernels; speed runs) instead
    of the explicit softmax (deterministic backward; correctness runs)."""

    def with_(self, **changes: object) -> Shape:
        """A copy with some fields changed."""
        return Shape(**{**self.__dict__, **changes})  # type: ignore[arg-type]


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.heads, self.dropout, self.sdpa = shape.heads, shape.dropout, shape.sdpa
        self.qkv = nn.Linear(shape.dim, 3 * shape.dim)
        self.proj = nn.Linear(shape.dim, shape.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = F.dropout(att.masked_fill(~mask, float("-inf")).softmax(-1), p, self.training)
            y = att @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x GELU MLP, each with dropout."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(shape.dim), nn.LayerNorm(shape.dim)
        self.attn = Attention(shape)
        self.fc = nn.Linear(shape.dim, 4 * shape.dim)
        self.out = nn.Linear(4 * shape.dim, shape.dim)
        self.drop = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """Token and position embeddings, blocks, final norm, tied head; returns the mean
    cross-entropy (computed in fp32) of ``targets``."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.vocab = shape.vocab
        self.wte = nn.Embedding(shape.vocab, shape.dim)
        self.wpe = nn.Embedding(shape.seq, shape.dim)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init; residual projections scaled by depth
                std = (
                    0.02 / math.sqrt(2 * shape.layers)
                    if name.endswith(("proj.weight", "out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if logits.dtype != torch.float64:  # 16-bit logits: the loss in fp32 (float64 stays)
            logits = logits.float()
        return F.cross_entropy(logits.view(-1, self.vocab), targets.reshape(-1))


def build(shape: Shape, seed: int, device: torch.device) -> GPT:
    """The GPT of ``shape`` with seeded fp32 weights, built directly on ``device``."""
    torch.manual_seed(seed)
    with device:
        return GPT(shape)


def count_params(model: nn.Module) -> int:
    """Distinct parameters (the tied head counted once)."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(shape: Shape, n_params: int) -> float:
    """Training FLOPs per token: 6 per parameter (minus the position table, a lookup) plus
    the attention scores and values, 12 x layers x dim x seq (PaLM's appendix B)."""
    return 6.0 * (n_params - shape.seq * shape.dim) + 12.0 * shape.layers * shape.dim * shape.seq


def batches(
    shape: Shape, steps: int, batch: int, device: torch.device, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of (tokens, targets), ``batch`` sequences each, on ``device``; the
    targets are a fixed permutation of the tokens so the loss falls."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, shape.vocab, (batch, shape.seq), generator=gen)
        targets = (tokens * 5 + 1) % shape.vocab
        out.append((tokens.to(device), targets.to(device)))
    return out
