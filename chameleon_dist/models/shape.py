"""``TransformerShape``: the dimensions of a decoder-only transformer and of one micro-batch.

The one shape type of the package: the main job's Megatron-core GPT (``configs/jobs/``, ``model:``), the
Llama-style model that ``chameleon-trace --model llama2-7b`` records on meta tensors (``LlamaShape``, which
adds a dtype), and the planner's reproduction script all use it. A planner ``ModelProfile``
(``configs/models/``) also describes the architecture (grouped-query attention, experts, activation, ...);
``ModelProfile.shape(micro_batch_size)`` gives its dimensions as a ``TransformerShape``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator


class TransformerShape(BaseModel):
    """Size of a model and of one micro-batch. ``ffn_hidden_size`` defaults to ``4 * hidden_size`` (as in
    Megatron's ``TransformerConfig``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    ffn_hidden_size: PositiveInt | None = None
    vocab_size: PositiveInt
    seq_length: PositiveInt
    micro_batch_size: PositiveInt

    @model_validator(mode="after")
    def _check(self) -> TransformerShape:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def describe(self) -> str:
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_attention_heads} heads, "
                f"seq {self.seq_length}, micro-batch {self.micro_batch_size}, vocab {self.vocab_size}")
