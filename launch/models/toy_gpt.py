"""The plain-PyTorch GPT of the launch/ benchmarks (bench_profiler.py, bench_policy.py, bench_executor.py).

Pre-norm blocks (layer norm, fused QKV projection, causal ``scaled_dot_product_attention``, output
projection, residual; layer norm, GELU MLP, residual), token embedding, final norm and an untied head. Blocks
live at ``layers.<i>``: the recorder times them and the policy generator's logical layers follow them.

The keyword options are the ones the benchmarks and tests use (each fixes parameter names and registration
order, hence ``parameters()`` order and the optimizer's op order, and the order in which parameters draw from
the RNG after ``torch.manual_seed``, hence their values):

    bench_profiler.py: GPT(vocab, hidden, heads, layers, positions=seq, norms_first=False)
    swap_variants.py (bench_executor, bench_sweep), bench_gpu.py: GPT(vocab, hidden, heads, layers)
    bench_policy.py:   GPT(vocab, hidden, heads, layers, mlp_module=True, experts=..., top_k=...)
    bench_dynamic.py, tests/test_dynamic_sequences.py: GPT(..., experts=..., top_k=2, skip_idle_experts=True)
    train_deepspeed.py: Block and MoEFeedForward
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class FeedForward(nn.Module):
    """The GELU MLP as a module of its own (``mlp.fc1``, ``mlp.fc2``)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoEFeedForward(nn.Module):
    """Top-k routing over expert MLPs; each expert runs on the tokens routed to it. The router's bias is
    skewed so that the token counts per expert are uneven; ``counts`` holds those of the last forward.
    ``skip_idle``: an expert that gets no token does not run at all (as Hugging Face Mixtral's eager loop
    does), so its ops are missing from the iteration; otherwise it runs on zero tokens."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, skip_idle: bool = False) -> None:
        super().__init__()
        self.top_k = top_k
        self.skip_idle = skip_idle
        self.router = nn.Linear(hidden, experts)
        with torch.no_grad():
            self.router.bias.copy_(torch.linspace(1.5, -1.5, experts))
        self.experts = nn.ModuleList(FeedForward(hidden, ffn) for _ in range(experts))
        self.counts: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        gates, choice = self.router(flat).softmax(dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        counts = []
        for e, expert in enumerate(self.experts):
            token, slot = (choice == e).nonzero(as_tuple=True)
            counts.append(token.numel())
            if self.skip_idle and not token.numel():
                continue
            out = out.index_add(0, token, expert(flat[token]) * gates[token, slot].unsqueeze(1))
        self.counts = tuple(counts)
        return out.view(b, s, h)


class Block(nn.Module):
    """One pre-norm transformer layer.

    ``mlp``: None builds the MLP in the block itself (``fc1``, ``fc2``, drawing from the RNG after ``qkv`` and
    ``proj``); a module (built by the caller, so before this block's own linears) is used as ``mlp``.
    ``norms_first``: register ``ln1, ln2, qkv, proj`` (True) or ``ln1, qkv, proj, ln2`` (False), then the MLP.
    Only the registration order differs (layer norms draw nothing from the RNG)."""

    def __init__(self, hidden: int, heads: int, mlp: nn.Module | None = None, *, norms_first: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        if norms_first:
            self.ln2 = nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        if not norms_first:
            self.ln2 = nn.LayerNorm(hidden)
        self.mlp = mlp  # a module is registered here; None is a plain attribute
        if mlp is None:
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        y = self.ln2(x)
        y = self.fc2(F.gelu(self.fc1(y))) if self.mlp is None else self.mlp(y)
        return x + y


class GPT(nn.Module):
    """Pre-norm GPT; layers at ``layers.<i>``.

    ``positions`` > 0: a learned position embedding (``position``, after ``embed``) of that many positions,
    added to the token embedding. ``mlp_module``: every layer's MLP is a ``FeedForward`` at ``layers.<i>.mlp``
    (built before the layer's attention); with ``experts`` > 0 every odd layer's is a ``MoEFeedForward`` of
    that many experts with top-``top_k`` routing (``experts`` implies ``mlp_module``; ``skip_idle_experts``:
    see ``MoEFeedForward``). ``norms_first``: see ``Block``."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, *, positions: int = 0,
                 norms_first: bool = True, mlp_module: bool = False, experts: int = 0, top_k: int = 2,
                 skip_idle_experts: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(positions, hidden) if positions else None
        self.layers = nn.ModuleList(
            Block(hidden, heads, self._mlp(i, hidden, mlp_module, experts, top_k, skip_idle_experts),
                  norms_first=norms_first)
            for i in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    @staticmethod
    def _mlp(index: int, hidden: int, mlp_module: bool, experts: int, top_k: int,
             skip_idle: bool = False) -> nn.Module | None:
        if experts and index % 2:
            return MoEFeedForward(hidden, 4 * hidden, experts, top_k, skip_idle)
        return FeedForward(hidden, 4 * hidden) if mlp_module or experts else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.position is not None:
            x = x + self.position.weight[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def forward_matmul_flop(vocab: int, hidden: int, layers: int, seq: int, batch: int) -> int:
    """Matmul FLOP of one forward pass of ``GPT(vocab, hidden, heads, layers)`` (any heads; no MLP module, no
    experts) on ``batch`` sequences of ``seq`` tokens, counted from the shape: per token and layer 2 x (3h^2 for QKV + h^2
    for the output projection + 8h^2 for the MLP) plus the attention products (QK^T and attention x V,
    2 x 2 x seq x h, counted in full although the causal mask lets the kernel skip about half), and the head
    (2 x h x vocab per token). The embedding is a gather (no FLOP); norms, GELU and softmax are not matmuls.
    Backward does twice the forward's matmul FLOP (the gradient of each product's input and of its weight)."""
    tokens = batch * seq
    per_layer = tokens * (2 * 12 * hidden * hidden + 4 * seq * hidden)
    return layers * per_layer + tokens * 2 * hidden * vocab
