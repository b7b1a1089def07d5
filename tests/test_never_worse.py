"""Swapping is never worse than not swapping: at a capacity where the run without Chameleon fits, the run
with it fits too, also when a graph is run backward twice (``retain_graph=True``) or differentiated twice
(a gradient penalty, ``create_graph=True``), where a restore happens while the device original is still
alive. Gradients stay bit-identical."""

import pytest
import torch
from torch.nn import functional as F

from chameleon_dist import Chameleon, EmulatedDevice
from tests.models import lm_batch, make_lm

MODEL = dict(vocab=64, hidden=32, heads=4, layers=2, dropout=0.0)
ITERATIONS = 4  # WarmUp, two GenPolicy trials, Stable


def _loss_and_hidden_states(model, tokens, labels):
    """As Hugging Face models with ``output_hidden_states=True``: every block's output is returned (and
    held by the caller) while the next block saved it for backward."""
    hidden_states = [model.embed(tokens)]
    for block in model.blocks:
        hidden_states.append(block(hidden_states[-1]))
    logits = F.linear(model.norm(hidden_states[-1]), model.embed.weight)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)), hidden_states


def _retain_graph_twice(model, tokens, labels):
    loss, hidden_states = _loss_and_hidden_states(model, tokens, labels)
    loss.backward(retain_graph=True)  # the graph (and what it saved) survives the first backward
    loss.backward()
    return loss.detach()


def _gradient_penalty(model, tokens, labels):
    loss, hidden_states = _loss_and_hidden_states(model, tokens, labels)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=True)
    penalty = sum(g.pow(2).sum() for g in grads)
    (loss + 0.01 * penalty).backward()
    return loss.detach()


PATTERNS = [_retain_graph_twice, _gradient_penalty]


def _run(step, chameleon):
    model = make_lm(0, **MODEL)
    chameleon.attach(model)
    results, swapped_bytes = [], 0
    for iteration in range(ITERATIONS):
        tokens, labels = lm_batch(iteration, batch=2, seq=32, vocab=MODEL["vocab"])
        loss = chameleon.run_iteration(lambda: step(model, tokens, labels))
        assert chameleon.last_report.oom_retries == 0, f"iteration {iteration} needed a retry"
        swapped_bytes += chameleon.last_report.swap_out_bytes
        results.append((loss, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    assert swapped_bytes > 0 or not chameleon.config.enabled
    return results


def _runtime(capacity_bytes, enabled=True):
    profiler = {"warmup_iterations": 1, "policy_trials": 2}
    return Chameleon({"enabled": enabled, "min_swap_bytes": 1024, "profiler": profiler},
                     device=EmulatedDevice(capacity_bytes))


@pytest.mark.parametrize("step", PATTERNS, ids=lambda f: f.__name__.strip("_"))
def test_fits_wherever_the_run_without_swapping_fits(step):
    unswapped = _runtime(10**10, enabled=False)
    reference = _run(step, unswapped)
    capacity_bytes = int(unswapped.last_report.peak_device_bytes * 1.005)

    without = _runtime(capacity_bytes, enabled=False)
    _run(step, without)  # fits: the premise of the test
    with_swap = _runtime(capacity_bytes)
    results = _run(step, with_swap)
    for (loss, grads), (ref_loss, ref_grads) in zip(results, reference):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_a_restore_of_a_live_original_reuses_it():
    """The user still holds the saved tensor: backward gets it back without a copy or new device bytes."""
    def peak(enabled):
        chameleon = Chameleon({"enabled": enabled, "min_swap_bytes": 0}, device=EmulatedDevice(10**9))
        x = torch.randn(128, 128, requires_grad=True, generator=torch.Generator().manual_seed(0))
        with chameleon.iteration():
            y = x.sigmoid()  # saved by sigmoid, and held by the user until after backward
            y.sum().backward()
        assert torch.equal(x.grad, (y * (1 - y)).detach())
        return chameleon.last_report

    swapped, unswapped = peak(True), peak(False)
    assert swapped.swap_out_bytes == 128 * 128 * 4 and swapped.swap_in_bytes == 0
    assert swapped.peak_device_bytes == unswapped.peak_device_bytes


def test_a_tensor_unpacked_twice_is_restored_once():
    chameleon = Chameleon({"min_swap_bytes": 0}, device=EmulatedDevice(10**9))
    x = torch.randn(128, 128, requires_grad=True)
    with chameleon.iteration():
        z = x.sin().cos().sum()  # nothing but the graph holds what sin and cos saved
        z.backward(retain_graph=True)
        z.backward()
    report = chameleon.last_report
    assert report.swap_in_bytes == report.swap_out_bytes > 0


class _NeedsScratch(torch.autograd.Function):
    """Identity forward whose backward needs a large scratch buffer, as softmax's backward does."""

    @staticmethod
    def forward(ctx, x, scratch_bytes):
        ctx.scratch_bytes = scratch_bytes
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.empty(ctx.scratch_bytes, dtype=torch.uint8).fill_(1)
        return grad + 0, None


def _chain_gradient(device, prefetch_depth):
    """Six 1 MiB ``exp`` outputs, all swapped; backward prefetches ``prefetch_depth`` of them ahead and then
    needs a 3 MiB scratch buffer."""
    from chameleon_dist.executor import IterationContext, SwapExecutor

    executor = SwapExecutor(device, min_swap_bytes=0, prefetch_depth=prefetch_depth)
    device.set_pressure_handler(executor.relieve_pressure)
    x0 = torch.randn(2**18, generator=torch.Generator().manual_seed(0)).requires_grad_()
    device.track(x0)
    with device.active(), executor.active(IterationContext()) as counters:
        x = x0
        for i in range(6):
            x = (x * 0.5).exp()
            if i == 4:
                x = _NeedsScratch.apply(x, 3 * 2**20)
        x.sum().backward()
    return x0.grad, counters


@pytest.mark.parametrize("link_bytes_per_s", [None, 200e6], ids=["instant-link", "slow-link"])
def test_prefetching_ahead_never_costs_an_out_of_memory_error(link_bytes_per_s):
    """Prefetched swap-ins hold device memory before backward needs them. Under pressure they go back (their
    host copies are still there) instead of failing a capacity at which the run without prefetching fits:
    in a multi-rank job there is no retry to fall back on."""
    def device():
        return EmulatedDevice(8 * 2**20, h2d_bytes_per_s=link_bytes_per_s, d2h_bytes_per_s=link_bytes_per_s)

    without_prefetch, _ = _chain_gradient(device(), prefetch_depth=0)
    with_prefetch, counters = _chain_gradient(device(), prefetch_depth=5)
    assert torch.equal(without_prefetch, with_prefetch)
    assert counters.prefetched > 0 and counters.evicted_prefetches > 0
