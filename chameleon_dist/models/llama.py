"""A detailed ``StepTrace`` of a Llama-style decoder built on the ``meta`` device (no memory, no compute).

Its shape is a ``LlamaShape``; ``chameleon-trace --model llama2-7b`` takes it from the planner's
``configs/models/llama2-7b.yaml`` (``LlamaShape.from_profile``).

The model is plain PyTorch: token embedding, ``num_layers`` decoder layers (RMSNorm, attention with
q/k/v/o projections, rotary positions, causal softmax attention with plain matmuls, RMSNorm, SwiGLU MLP),
a final RMSNorm and an untied output projection; the loss is cross-entropy on fp32 logits. One forward
and backward pass runs through the same ``TraceRecorder`` the runtime uses, with a byte counter for meta
storages (the emulated device meters CPU storages only) and a saved-tensor hook that marks what autograd
keeps. Storage lifetimes come from ``weakref.finalize``, which fires on meta storages as on CPU ones.

Activation estimate (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 16-bit, no recompute, no parallelism): ``s*b*h*(34 + 5*a*s/h)`` bytes per layer. This model
differs from the GPT-3 layer behind that formula, so :func:`llama_layer_bytes` adjusts it term by term:

- no dropout: minus ``3*a*s*s*b`` (attention dropout mask and output; softmax output is saved by the
  ``probs @ V`` matmul instead) and minus ``2*s*b*h`` (the two hidden-dropout masks);
- SwiGLU instead of GeLU(4h): minus ``16*s*b*h``, plus ``8*s*b*F`` (gate, up, silu(gate), silu*up);
- RMSNorm in the model dtype instead of a fused LayerNorm: plus ``4*s*b*h`` (each norm also keeps its
  normalised input for the weight multiply) plus ``4*s*b`` (the per-token rstd of both norms);
- rotary positions add nothing (q and k are saved after rotation, in place of q and k).
So per layer, for 2-byte dtypes: ``20*s*b*h + 8*s*b*F + 2*a*s*s*b + 4*s*b``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import model_validator
from torch import nn

from chameleon_dist.device.meter import StorageMeter
from chameleon_dist.models.shape import TransformerShape
from chameleon_dist.profiler.recorder import TraceRecorder
from chameleon_dist.profiler.scope import TrainingScope
from chameleon_dist.profiler.signature import OpVocabulary
from chameleon_dist.trace.step_trace import BACKWARD, StepTrace

if TYPE_CHECKING:
    from chameleon_dist.planner.profiles import ModelProfile


class LlamaShape(TransformerShape):
    """A ``TransformerShape`` for this model: its dtype, a SwiGLU width given explicitly (no ``4 * hidden``
    default), and an even head dimension (rotary positions)."""

    dtype: str = "bfloat16"

    @model_validator(mode="after")
    def _check(self) -> "LlamaShape":  # replaces TransformerShape._check
        if self.ffn_hidden_size is None:
            raise ValueError("ffn_hidden_size must be given (the SwiGLU width has no default)")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) into an even head dimension (rotary positions)"
            )
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype (e.g. bfloat16)")
        return self

    @classmethod
    def from_profile(cls, profile: "ModelProfile", micro_batch_size: int = 1, dtype: str = "bfloat16") -> "LlamaShape":
        """A planner model profile (``configs/models/``) as this model's shape; the profile must describe
        this architecture (the Llama 2 7B and 13B profiles do)."""
        wanted = {  # profile field: (its value, the value this model has)
            "activation": (profile.activation, "swiglu"),
            "normalization": (profile.normalization, "rmsnorm"),
            "position_embedding": (profile.position_embedding, "rope"),
            "add_bias_linear": (profile.add_bias_linear, False),
            "tie_embeddings": (profile.tie_embeddings, False),
            "num_experts": (profile.num_experts, 0),
            "num_query_groups": (profile.query_groups, profile.num_attention_heads),
        }
        different = {name: value for name, (value, this_model) in wanted.items() if value != this_model}
        if different:
            raise ValueError(f"model profile {profile.name!r} is not this Llama-style model: "
                             + ", ".join(f"{name} {value!r}" for name, value in different.items()))
        return cls(**profile.shape(micro_batch_size).model_dump(), dtype=dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def parameter_count(self) -> int:
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        return 2 * v * h + self.num_layers * (4 * h * h + 3 * h * f + 2 * h) + h

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_attention_heads} heads, "
            f"seq {self.seq_length}, micro-batch {self.micro_batch_size}, ffn {self.ffn_hidden_size}, "
            f"vocab {self.vocab_size}, {self.dtype}, {self.parameter_count() / 1e6:,.1f} M parameters"
        )


# Shipped planner profiles (configs/models/) of this architecture: ``chameleon-trace --model NAME``.
LLAMA_MODELS = ("llama2-7b",)


# ---- the model ------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        h = shape.hidden_size
        self.heads, self.head_dim = shape.num_attention_heads, shape.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(h, h, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        probs = torch.softmax(scores.masked_fill(causal_mask, float("-inf")), dim=-1)
        return self.o_proj(torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h))


class SwiGLU(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        h, f = shape.hidden_size, shape.ffn_hidden_size
        self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.input_norm, self.self_attn = RMSNorm(shape.hidden_size), Attention(shape)
        self.post_attention_norm, self.mlp = RMSNorm(shape.hidden_size), SwiGLU(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_norm(x), cos, sin, causal_mask)
        return x + self.mlp(self.post_attention_norm(x))


class LlamaModel(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        s, d = shape.seq_length, shape.head_dim
        inverse_frequency = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.outer(torch.arange(s, dtype=torch.float32), inverse_frequency).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("causal_mask", torch.ones(s, s, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, self.causal_mask)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def build_llama(shape: LlamaShape, device: str | torch.device = "meta") -> LlamaModel:
    """The model with parameters (and rotary/mask buffers) in ``shape.dtype`` on ``device``."""
    with torch.device(device):
        model = LlamaModel(shape)
    return model.to(shape.torch_dtype)


# ---- recording -----------------------------------------------------------------------------------
UNBOUNDED_BYTES = sys.maxsize


class _SavedTensorMarker:
    """Saved-tensor hooks: tell the recorder, hand autograd a detached alias (the tensor itself would
    form a reference cycle through its own grad_fn; see ``executor.records.KeptTensor``)."""

    def __init__(self, recorder: TraceRecorder, scope: TrainingScope) -> None:
        self._recorder = recorder
        self._scope = scope

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        with self._scope.quiet():  # the hook's own detach is not part of the model's sequence
            self._recorder.on_saved(tensor)
            return tensor.detach()

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@dataclasses.dataclass
class MetaTraceResult:
    shape: LlamaShape
    trace: StepTrace
    build_s: float
    record_s: float
    model_state_bytes: int  # parameters and buffers
    counter_peak_bytes: int


def record_meta_trace(shape: LlamaShape, device: str | torch.device = "meta") -> MetaTraceResult:
    """One forward + backward of a Llama-shaped model on ``device`` through a ``TraceRecorder``."""
    start_s = time.perf_counter()
    model = build_llama(shape, device)
    build_s = time.perf_counter() - start_s
    b, s = shape.micro_batch_size, shape.seq_length
    tokens = torch.zeros(b, s, dtype=torch.int64, device=device)
    labels = torch.zeros(b, s, dtype=torch.int64, device=device)
    state = list(model.parameters()) + list(model.buffers())
    counter = StorageMeter(UNBOUNDED_BYTES, include_meta=True)
    for tensor in state + [tokens, labels]:
        counter.track(tensor)
    model_state_bytes = counter.live_bytes - 2 * tokens.untyped_storage().nbytes()
    scope = TrainingScope()
    scope.watch(model)
    recorder = TraceRecorder(
        OpVocabulary(), lambda: counter.live_bytes, {t.untyped_storage()._cdata for t in state}, iteration=1,
        emulated=True, scope=scope,
    )
    recorder.watch_modules(model)
    marker = _SavedTensorMarker(recorder, scope)
    start_s = time.perf_counter()
    try:
        with counter, recorder, torch.autograd.graph.saved_tensors_hooks(marker.pack, marker.unpack):
            loss = model(tokens, labels)
            loss.backward()
            del loss
    finally:
        trace = recorder.finish()
    record_s = time.perf_counter() - start_s
    return MetaTraceResult(shape, trace, build_s, record_s, model_state_bytes, counter.peak_bytes)


def time_meta_iteration(shape: LlamaShape, device: str | torch.device = "meta") -> float:
    """Seconds for the same forward + backward without any recording (for comparison)."""
    model = build_llama(shape, device)
    tokens = torch.zeros(shape.micro_batch_size, shape.seq_length, dtype=torch.int64, device=device)
    start_s = time.perf_counter()
    model(tokens, tokens).backward()
    return time.perf_counter() - start_s


# ---- analysis ------------------------------------------------------------------------------------
def saved_bytes_by_layer(trace: StepTrace) -> dict[int, int]:
    """Bytes of saved (non-parameter) storages by the layer of the op that created them (-1: none).

    A layer's input is made by the layer before it, and its output is saved by the next one, so every
    layer is charged exactly one layer's worth."""
    by_layer: dict[int, int] = {}
    seen: set[int] = set()
    for tensor in trace.tensors:
        if not tensor.saved or tensor.is_parameter or tensor.storage_id in seen:
            continue
        seen.add(tensor.storage_id)
        storage = trace.storages[tensor.storage_id]
        layer = trace.ops[storage.created_at].layer if storage.created_at >= 0 else -1
        by_layer[layer] = by_layer.get(layer, 0) + storage.nbytes
    return by_layer


def korthikanti_layer_bytes(shape: LlamaShape) -> int:
    """``s*b*h*(34 + 5*a*s/h)``: a GPT-3 layer, 16-bit, no recompute, no parallelism."""
    s, b, h, a = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.num_attention_heads
    return 34 * s * b * h + 5 * a * s * s * b


def llama_layer_bytes(shape: LlamaShape) -> int:
    """The same count for this layer (see the module docstring): in elements, ``10*s*b*h + 4*s*b*F +
    a*s*s*b + 2*s*b`` times the element size (``20sbh + 8sbF + 2as^2b + 4sb`` for 16-bit)."""
    s, b, h, a = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.num_attention_heads
    elements = 10 * s * b * h + 4 * s * b * shape.ffn_hidden_size + a * s * s * b + 2 * s * b
    return elements * shape.torch_dtype.itemsize


def llama_outside_layers_bytes(shape: LlamaShape) -> int:
    """Saved outside the layers: final RMSNorm (input, normalised input, rstd), the output projection's
    input, the fp32 log-softmax of the logits (``4*s*b*V``) and the int64 tokens and labels."""
    s, b, h = shape.seq_length, shape.micro_batch_size, shape.hidden_size
    return (3 * s * b * h + s * b) * shape.torch_dtype.itemsize + 4 * s * b * shape.vocab_size + 2 * 8 * s * b


def end_of_forward(trace: StepTrace) -> int:
    """Index of the last forward op before the first backward op (-1 without backward)."""
    for index, op in enumerate(trace.ops):
        if op.phase == BACKWARD:
            return index - 1
    return -1
