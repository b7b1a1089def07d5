"""``FusedDotProductAttention``: Megatron-core's core attention through ``torch.nn.functional.scaled_dot_product_attention``,
for models without Transformer Engine that should save what a GPU run with fused attention saves.

Megatron-core's own ``DotProductAttention`` (the only training attention without Transformer Engine) computes
the ``[b * heads, s, s]`` scores with ``baddbmm``, their softmax and the probabilities, and saves the
probabilities for backward: at seq 4096 that is more than every other activation of the layer together. GPU
users train with Transformer Engine's fused (flash) attention instead, which saves the query, key, value, the
output and a log-sum-exp per row. This module is a drop-in ``core_attention`` for Megatron's layer spec (its
documented extension point; nothing of Megatron's is changed) that calls the fused kernel torch picks (on CPU
and on the emulated device's meta tensors: ``_scaled_dot_product_flash_attention_for_cpu``, which saves the
same tensors as a GPU's flash kernel). On meta tensors it calls the emulated device's choice directly
(``device/simulated/meta.py``: also when Megatron's recomputation replays it in backward, where no function mode is
active). Grouped-query attention goes in as it is (``enable_gqa``: no repeated
keys and values). Causal masks only, no attention dropout, no query-key layer scaling, no packed sequences: anything else is
refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chameleon_dist.device.simulated.meta import attention as meta_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class FusedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` whose forward is one fused attention call (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, *args, **kwargs) -> None:
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"FusedDotProductAttention takes causal masks only, got {attn_mask_type}")
        if config.apply_query_key_layer_scaling:
            raise ValueError("FusedDotProductAttention: set apply_query_key_layer_scaling=False (its softmax rescale "
                             "is inside Megatron's unfused softmax)")
        if config.attention_dropout:
            raise ValueError(f"FusedDotProductAttention has no attention dropout: set attention_dropout=0 "
                             f"(got {config.attention_dropout})")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """``[s, b, heads, d]`` query, ``[s, b, groups, d]`` key and value -> ``[s, b, heads * d]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("FusedDotProductAttention takes no packed sequences and no attention bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d] (views)
        attend = meta_attention if q.device.type == "meta" else F.scaled_dot_product_attention
        context = attend(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1))
        s, b = query.size(0), query.size(1)
        return context.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)
