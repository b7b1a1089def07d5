"""Fused attention that runs out of memory is relieved and retried when it draws nothing (NOTE [Relief inside
the op] in device/dispatch.py).

Every ``_scaled_dot_product_*_attention`` forward, and the efficient and cuDNN attention backward, carry the
``nondeterministic_seeded`` tag whatever their ``dropout_p``; at ``dropout_p == 0`` they touch no generator,
so a retry after relief gives the bytes the first run would have. ``retryable`` reads the same dropout rule
as the exactness judge (trace/exactness.py). The CUDA kernels run here on meta tensors under the emulated
device (their meta kernels allocate the outputs a GPU would); the CPU flash kernel runs on real data."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from chameleon_dist.device.dispatch import retryable
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.device.leaves import tensor_leaves
from chameleon_dist.device.simulated.memory import block_bytes

aten = torch.ops.aten
MiB = 2**20
B, H, S, D = 2, 4, 64, 32


def _stored_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t): t for t in tensors}
    return sum(block_bytes(t.untyped_storage().nbytes()) for t in storages.values())


def _run_short(call, inputs: list[torch.Tensor]):
    """``call(*inputs)`` on an emulated device whose capacity fits its outputs only once the pressure handler
    frees a spare MiB. Returns (the result or the error, the handler's calls, the device, the plain result)."""
    expected = call(*inputs)
    meta = inputs[0].device.type == "meta"
    spare = [torch.ones(MiB // 4, device=inputs[0].device)]
    capacity_bytes = _stored_bytes([*inputs, spare[0]]) + _stored_bytes(tensor_leaves(expected)) - 512
    device = EmulatedDevice(capacity_bytes, meta_tensors=meta)
    for tensor in inputs:
        device.track(tensor)
    device.track(spare[0])  # (held by the list only: the handler frees it)
    calls = []

    def handler(short_bytes: int) -> int:
        calls.append(short_bytes)
        spare.clear()
        return MiB

    device.set_pressure_handler(handler)
    try:
        with device.active():
            result = call(*inputs)
    except torch.OutOfMemoryError as error:
        result = error
    return result, calls, device, expected


def _qkv(device: str = "meta") -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(B, H, S, D, device=device) for _ in range(3)]


def _efficient_backward(p: float):
    def call(q, k, v):
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True, p)
        return aten._scaled_dot_product_efficient_attention_backward.default(
            out, q, k, v, q.new_empty(0), out, lse, seed, offset, p, [True, True, True, False])
    return call


FUSED = {  # name -> (dropout_p -> a call of the op on q, k, v)
    "flash": lambda p: lambda q, k, v: aten._scaled_dot_product_flash_attention.default(q, k, v, p),
    "efficient": lambda p: lambda q, k, v: aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True, p),
    "cudnn": lambda p: lambda q, k, v: aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, True, p),
    "efficient_backward": _efficient_backward,
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_attention_without_dropout_that_runs_short_is_relieved_and_retried(name):
    result, calls, device, _ = _run_short(FUSED[name](0.0), _qkv())
    assert not isinstance(result, torch.OutOfMemoryError), f"{name} attention at dropout_p=0 was not retried"
    assert len(calls) == 1 and device.dispatch.relieved_ops == 1


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_attention_with_dropout_that_runs_short_is_not_retried(name):
    result, calls, device, _ = _run_short(FUSED[name](0.1), _qkv())
    assert isinstance(result, torch.OutOfMemoryError)  # a retry would draw another mask
    assert calls == [] and device.dispatch.relieved_ops == 0


def test_cpu_attention_that_runs_short_is_retried_bit_identically():
    """Real data: sdpa on CPU runs ``_scaled_dot_product_flash_attention_for_cpu`` (seeded, dropout_p=0)."""
    inputs = _qkv("cpu")
    random_state = torch.get_rng_state()
    result, calls, device, expected = _run_short(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), inputs)
    assert len(calls) == 1 and device.dispatch.relieved_ops == 1
    assert torch.equal(result, expected)
    assert torch.equal(torch.get_rng_state(), random_state)  # neither run drew from the generator


def test_retryable_reads_dropout_p_where_the_judge_does():
    q = torch.empty(0)
    flash = aten._scaled_dot_product_flash_attention.default
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert retryable(flash, (q, q, q), {}) and retryable(flash, (q, q, q, 0.0, True), {})
    assert not retryable(flash, (q, q, q, 0.2), {}) and not retryable(flash, (q, q, q), {"dropout_p": 0.2})
    assert retryable(efficient, (q, q, q, None, True), {"dropout_p": 0.0})
    assert not retryable(efficient, (q, q, q, None, True, 0.5), {})
    assert not retryable(flash, (q, q, q, q), {})  # a tensor dropout_p is not known to be zero
    # seeded ops with nothing to say they draw nothing stay refused
    assert not retryable(aten.native_dropout.default, (q, 0.0, True), {})
    assert retryable(aten.native_dropout.default, (q, 0.5, False), {})
    assert not retryable(aten.bernoulli.p, (q, 0.0), {})  # a Generator argument
