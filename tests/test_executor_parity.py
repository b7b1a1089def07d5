"""Swapping never changes training: losses and every gradient are bit-identical (torch.equal)."""

import pytest
import torch

from chameleon_dist import Chameleon, EmulatedDevice
from tests.models import lm_batch, lm_loss, make_lm


def _config(min_swap_bytes=0, **extra):
    # WarmUp throughout: the baseline executor swaps every eligible activation (a policy would swap none
    # on this unbounded device)
    extra.setdefault("profiler", {"warmup_iterations": 10**6})
    return {"min_swap_bytes": min_swap_bytes, "device": {"kind": "emulated"}, **extra}


def train(steps, chameleon=None, micro_batches=2, seed=0, **model_kwargs):
    """Losses and gradients of every step (gradient accumulation over ``micro_batches``)."""
    model = make_lm(seed, **model_kwargs)
    if chameleon is not None:
        chameleon.attach(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(seed + 1)  # dropout draws the same numbers in every run
    losses, grads = [], []
    for step in range(steps):
        def closure():
            total = torch.zeros(())
            for micro in range(micro_batches):
                tokens, labels = lm_batch(step * micro_batches + micro)
                loss = lm_loss(model, tokens, labels) / micro_batches
                loss.backward()
                total += loss.detach()
            return total

        if chameleon is None:
            loss = closure()
        else:
            with chameleon.iteration():
                loss = closure()
        losses.append(loss)
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


def assert_bit_identical(reference, candidate):
    ref_losses, ref_grads = reference
    losses, grads = candidate
    assert len(losses) == len(ref_losses)
    for step, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"loss differs at step {step}: {a.item()} vs {b.item()}"
    for step, (ga, gb) in enumerate(zip(ref_grads, grads)):
        for i, (x, y) in enumerate(zip(ga, gb)):
            assert torch.equal(x, y), f"gradient {i} differs at step {step}"


def test_eight_steps_bit_identical_with_every_activation_swapped():
    """(Was fifty steps, 12.5 s loaded. Every step's loss and every gradient are compared, not only the last, so
    a swapped activation that comes back wrong fails at the first step it happens; eight Adam steps still reuse
    the host pool's buffers seven times over and move the weights each step, as fifty did.)"""
    reference = train(8)
    chameleon = Chameleon(_config())
    candidate = train(8, chameleon)
    report = chameleon.last_report
    assert report.swap_out_bytes > 0 and report.swapped_storages > 10, "the test must really swap"
    assert report.swap_in_bytes + report.reused_original_bytes == report.swap_out_bytes, (
        "everything swapped out came back for backward (copied in, or its live original reused)"
    )
    assert report.stage == "warmup" and report.policy == "" and report.emulated  # the baseline executor
    assert_bit_identical(reference, candidate)


def test_bit_identical_over_a_slow_link_with_prefetch_in_flight():
    reference = train(4)
    device = EmulatedDevice(capacity_bytes=10**9, h2d_bytes_per_s=50e6, d2h_bytes_per_s=50e6)
    chameleon = Chameleon(_config(executor={"prefetch_depth": 3}), device=device)
    candidate = train(4, chameleon)
    assert chameleon.last_report.prefetched > 0
    assert chameleon.last_report.stall_s > 0, "a slow link shows up as stall time"
    assert_bit_identical(reference, candidate)


def test_min_swap_bytes_filters_small_tensors():
    chameleon_all = Chameleon(_config(min_swap_bytes=0))
    train(1, chameleon_all)
    chameleon_big = Chameleon(_config(min_swap_bytes=16 * 1024))
    train(1, chameleon_big)
    assert 0 < chameleon_big.last_report.swapped_storages < chameleon_all.last_report.swapped_storages


def test_parameters_and_tensors_packed_in_backward_are_never_swapped():
    from torch.utils.checkpoint import checkpoint

    model = make_lm(0)
    chameleon = Chameleon(_config())
    chameleon.attach(model)
    param_keys = {p.untyped_storage()._cdata for p in model.parameters()}
    swapped_keys, swapped_in_backward = [], []
    original = chameleon.device.copy_to_host

    def spy(storage, stream=None):
        swapped_keys.append(storage._cdata)
        swapped_in_backward.append(torch._C._current_graph_task_id() != -1)
        return original(storage, stream)

    chameleon.device.copy_to_host = spy
    tokens, labels = lm_batch(0)
    with chameleon.iteration():
        x = model.embed(tokens)
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=False)  # recomputed inside backward
        loss = torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(model.norm(x), model.embed.weight).flatten(0, 1), labels.flatten()
        )
        loss.backward()
    assert swapped_keys, "activations outside the checkpoints are swapped"
    assert not param_keys.intersection(swapped_keys), "a parameter (or a view of one) was swapped"
    assert not any(swapped_in_backward), "a tensor packed during backward (recompute) was swapped"


def test_in_place_change_after_save_raises_like_autograd():
    def run(chameleon):
        x = torch.randn(64, 64, requires_grad=True)
        with chameleon.iteration() if chameleon else _nothing():
            y = x * 2
            z = y.sin()  # saves y
            y.add_(1)
            with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
                z.sum().backward()
        return str(info.value)

    assert "expected version 0" in run(None)
    assert "expected version 0" in run(Chameleon(_config()))


def test_views_of_one_storage_share_one_host_copy_and_keep_their_strides():
    def grads(chameleon):
        x = torch.linspace(-2, 2, 32 * 48).reshape(32, 48).requires_grad_()
        with chameleon.iteration() if chameleon else _nothing():
            y = x.exp()  # exp saves its output y
            transposed = y.t()  # a transposed view of y's storage, saved by sin
            window = y[4:20, 8:40]  # an offset view of the same storage, saved by cos
            (transposed.sin().sum() + window.cos().sum()).backward()
        return x.grad

    chameleon = Chameleon(_config())
    swapped = grads(chameleon)
    assert chameleon.last_report.swap_out_bytes == 32 * 48 * 4, "one host copy for y and its two views"
    assert torch.equal(swapped, grads(None))


def test_retain_graph_backward_twice_reuses_the_swapped_in_copy():
    chameleon = Chameleon(_config())
    x = torch.randn(128, 128, requires_grad=True)
    with chameleon.iteration():
        z = x.sin().cos().sum()
        z.backward(retain_graph=True)
        first = x.grad.clone()
        z.backward()
    x_ref = x.detach().clone().requires_grad_()
    z_ref = x_ref.sin().cos().sum()
    z_ref.backward(retain_graph=True)
    z_ref.backward()
    assert torch.equal(first * 2, x.grad) and torch.equal(x.grad, x_ref.grad)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("min_swap_bytes", [0, 2**30], ids=["swapped", "kept"])
def test_forward_without_backward_frees_everything(min_swap_bytes):
    """A graph that is never run backward (an abandoned step, a forward pass with grad on) must be freed
    once its outputs die, whether its saved tensors were swapped or kept."""
    model = make_lm(0)
    chameleon = Chameleon(_config(min_swap_bytes=min_swap_bytes))
    chameleon.attach(model)
    at_rest = chameleon.device.live_bytes()
    tokens, labels = lm_batch(0)
    with chameleon.iteration():
        loss = lm_loss(model, tokens, labels)
        assert chameleon.device.live_bytes() > at_rest
        del loss
    chameleon.device.synchronize()
    assert chameleon.device.live_bytes() == at_rest


def test_in_place_change_of_a_kept_tensor_still_raises():
    chameleon = Chameleon(_config(min_swap_bytes=2**30))  # nothing is swapped
    x = torch.randn(64, 64, requires_grad=True)
    with chameleon.iteration():
        y = x * 2
        z = y.sin()
        y.add_(1)
        with pytest.raises(RuntimeError, match="expected version 0"):
            z.sum().backward()
    assert chameleon.last_report.swap_out_bytes == 0


def test_host_buffers_return_to_the_pool_when_a_graph_is_dropped_mid_backward():
    device = EmulatedDevice(capacity_bytes=10**9, h2d_bytes_per_s=200e6, d2h_bytes_per_s=200e6)
    chameleon = Chameleon(_config(executor={"prefetch_depth": 4}), device=device)
    x = torch.randn(64, 256, requires_grad=True)
    with chameleon.iteration():
        ys = [x * 1.0]
        for _ in range(6):
            ys.append(ys[-1].sin())  # each sin saves (and swaps) its input
        # backward through the last op only: unpacking its input starts prefetches of earlier inputs
        torch.autograd.grad(ys[-1].sum(), ys[-2])
        assert chameleon.executor.counters.prefetched > 0
        del ys  # the rest of the graph is abandoned with prefetches in flight
    device.synchronize()
    assert device.host_pool.in_use_bytes == 0
    assert device.host_pool.reserved_bytes > 0, "buffers are cached for reuse, not leaked"
