"""Small deterministic models for executor and runtime tests."""

import torch
from torch import nn
from torch.nn import functional as F


class TinyAttentionBlock(nn.Module):
    """Attention + MLP with the shapes of ops that matter for swapping: transposed views, softmax
    (saves its output), layer norm, GELU, dropout (RNG), and an in-place residual add."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / (h // self.heads) ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        attn = F.dropout(attn, self.dropout, self.training)
        out = (attn @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(out)
        y = self.fc2(F.gelu(self.fc1(self.norm2(x))))
        y += x  # in-place on a tensor nobody saved
        return y


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(TinyAttentionBlock(hidden, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)  # tied output layer: a parameter saved by matmul


def make_lm(seed: int = 0, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def lm_batch(step: int, batch: int = 4, seq: int = 16, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def train_next_token(chameleon, model: nn.Module, steps: int, vocab: int, batch: int, seq: int, after_step=None):
    """``steps`` SGD steps of next-token prediction on seeded random tokens through ``chameleon`` (which
    has ``model`` attached); ``after_step(chameleon)`` after each. Returns the losses and final parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(step))

        def closure():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            return loss.detach()

        losses.append(chameleon.run_iteration(closure, optimizer=optimizer))
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(chameleon)
    return losses, [p.detach().clone() for p in model.parameters()]
