"""What the simulated backend needs for meta tensors (NOTE [Meta tensors] in ``backend.py``): host buffers
with sizes and no data, and the attention kernel a device would choose.

``torch.nn.functional.scaled_dot_product_attention`` picks its kernel by device type. On meta tensors it
always takes the math path, which materialises the full score matrix (sequence x sequence per head) and
saves it for backward: at an LLM's sequence length that is more memory than the whole model state, where
a GPU's fused kernel saves only the output and its log-sum-exp. ``FusedAttentionChoice`` (entered by the
backend around each iteration on a meta-tensor device) asks the dispatcher which kernel the same call on
CPU tensors of the same sizes, strides and dtype would take, and where that is the fused kernel it calls it
on the meta tensors: the same aten op, the same saved tensors and the same backward as the real run on
the emulated device (a test runs one model both ways). Remove it when torch's meta device takes the fused
kernel by itself (``tests/test_meta_runtime.py`` checks that it still does not)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

_FLASH_ON_CPU = 1  # torch._fused_sdp_choice's answer for the fused (flash) kernel on CPU
_attention = torch.nn.functional.scaled_dot_product_attention
_flash_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def meta_host_buffer(nbytes: int) -> torch.Tensor:
    """A host buffer of a meta-tensor device: its size, no data."""
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")


def _cpu_stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``tensor``'s sizes, strides, dtype and ``requires_grad`` (its pages are never touched)."""
    stand_in = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
    return stand_in.requires_grad_(tensor.requires_grad)


def fused_on_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False) -> bool:
    """Whether the dispatcher would run this attention call's fused kernel on CPU tensors of these sizes."""
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        return False
    stand_ins = [_cpu_stand_in(t) for t in tensors]
    mask = stand_ins[3] if attn_mask is not None else None
    choice = torch._fused_sdp_choice(*stand_ins[:3], attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                     scale=scale, enable_gqa=enable_gqa)
    return choice == _FLASH_ON_CPU


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` with, on meta tensors, the kernel the same call on CPU would take. Modules
    that may be recomputed in backward call this directly: a ``TorchFunctionMode`` is not active when autograd
    replays a checkpointed forward, so ``FusedAttentionChoice`` covers only the first forward."""
    with _disable_current_modes():
        fused = fused_on_cpu(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if fused:
        return _flash_for_cpu(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return _attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                      enable_gqa=enable_gqa)


class FusedAttentionChoice(TorchFunctionMode):
    """Attention on meta tensors takes the fused kernel where the same call on CPU would (module docstring).
    The question is asked with every dispatch mode set aside: no device, recorder or meter sees the stand-ins."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _attention:
            return attention(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
