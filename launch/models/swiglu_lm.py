"""A small language model full of ops that are cheap to rebuild and costly to copy: RMSNorm + SwiGLU, then
LayerNorm + GELU MLP, each with a residual (launch/bench/bench_recompute.py, tests/test_recompute.py).

``checkpoint_layers=True`` recomputes whole layers in backward (``torch.utils.checkpoint``), the usual
alternative to swapping that the benchmark compares against."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


class RMSNorm(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class SwiGLULM(nn.Module):
    """Embedding, ``layers`` blocks at ``layers.<i>``, a final norm and an untied head."""

    def __init__(self, vocab: int, hidden: int, layers: int, checkpoint_layers: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        self.checkpoint_layers = checkpoint_layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpoint_layers else layer(x)
        return self.head(self.norm(x))
