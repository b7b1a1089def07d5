"""A tensor autograd saved and that is then modified in place must make backward raise autograd's error,
with Chameleon as without it: swapped (instant or slow link, copy done or still in flight), kept, or
passively swapped under memory pressure, and whether or not anything still references the tensor. A
gradient computed from modified or torn bytes is the worst failure this project can have."""

import pytest
import torch
from torch import nn

from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.executor import IterationContext

INPLACE_ERROR = "modified by an inplace operation"
SLOW_BYTES_PER_S = 2e6  # a 16 KiB copy takes ~8 ms: the write lands while the swap-out is in flight
LINKS = {"instant": None, "slow": SLOW_BYTES_PER_S}


def _sigmoid_then_scale(lin, x):
    a = torch.sigmoid(lin(x))  # sigmoid saves its output
    a.mul_(2)  # ... which is changed here; the local dies when the function returns
    return a.sum()


def _sigmoid_then_zero_a_view(lin, x):
    a = torch.sigmoid(lin(x))
    a[:, :8].zero_()  # a write through a view of the saved storage
    return a.sum()


def _saved_input_changed_then_dropped(lin, x):
    h = lin(x)
    g = torch.tanh(lin(x))
    y = h * g  # mul saves both of its inputs
    h.add_(1)  # one of them changes, and nothing references it after the function returns
    return y.sum()


def _written_by_out_argument(lin, x):
    a = torch.sigmoid(lin(x))
    with torch.no_grad():
        torch.mul(a, 3, out=a)  # an out= write (under no_grad) is a write too
    return a.sum()


PATTERNS = [_sigmoid_then_scale, _sigmoid_then_zero_a_view, _saved_input_changed_then_dropped, _written_by_out_argument]


def _model():
    torch.manual_seed(0)
    return nn.Linear(64, 64), torch.randn(64, 64)


def _runtime(link_bytes_per_s, min_swap_bytes=4096, capacity_bytes=10**9):
    device = EmulatedDevice(capacity_bytes, h2d_bytes_per_s=link_bytes_per_s, d2h_bytes_per_s=link_bytes_per_s)
    return Chameleon({"min_swap_bytes": min_swap_bytes, "profiler": {"warmup_iterations": 10**6}}, device=device)


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.__name__.strip("_"))
def test_plain_pytorch_raises_for_each_pattern(pattern):
    lin, x = _model()
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        pattern(lin, x).backward()


@pytest.mark.parametrize("link", LINKS, ids=str)
@pytest.mark.parametrize("kept", [False, True], ids=["swapped", "kept"])
@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.__name__.strip("_"))
def test_in_place_write_after_save_raises(pattern, kept, link):
    lin, x = _model()
    chameleon = _runtime(LINKS[link], min_swap_bytes=2**30 if kept else 4096)
    chameleon.attach(lin)
    for _ in range(3):  # every attempt raises; nothing of a failed one leaks into the next
        with pytest.raises(RuntimeError, match=INPLACE_ERROR):
            with chameleon.iteration():
                pattern(lin, x).backward()
        assert (chameleon.last_report.swap_out_bytes > 0) != kept
    assert lin.weight.grad is None or not kept  # never a silent result


@pytest.mark.parametrize("link", LINKS, ids=str)
def test_the_error_names_the_versions_like_autograd(link):
    lin, x = _model()
    chameleon = _runtime(LINKS[link])
    chameleon.attach(lin)
    with pytest.raises(RuntimeError, match=INPLACE_ERROR) as info:
        with chameleon.iteration():
            _sigmoid_then_scale(lin, x).backward()
    assert "is at version 1; expected version 0 instead" in str(info.value)


@pytest.mark.parametrize("link", LINKS, ids=str)
def test_a_write_to_an_unrelated_tensor_at_a_reused_address_is_not_an_error(link):
    """The storage a swap took dies; a new one may get its address. Writing to the new one is fine."""
    lin, x = _model()
    chameleon = _runtime(LINKS[link])
    chameleon.attach(lin)
    reference = nn.Linear(64, 64)
    reference.load_state_dict(lin.state_dict())
    with chameleon.iteration():
        loss = torch.sigmoid(lin(x)).sum()
        for _ in range(50):
            scratch = torch.empty(64, 64)
            scratch.fill_(1.0)  # a fresh storage, possibly at a dead one's address
        loss.backward()
    torch.sigmoid(reference(x)).sum().backward()
    assert torch.equal(lin.weight.grad, reference.weight.grad)


@pytest.mark.parametrize("link", LINKS, ids=str)
@pytest.mark.parametrize("write", ["before", "after"])
def test_in_place_write_to_a_passively_swapped_tensor_raises(write, link):
    """Tensors a policy kept are swapped out under memory pressure (a real passive swap, under autograd).
    One of them was changed in place before that swap, or is changed after it; then it is dropped.
    Backward raises either way."""
    w = torch.randn(256, 256, requires_grad=True)
    block_bytes = 256 * 256 * 4
    chameleon = _runtime(LINKS[link], capacity_bytes=5 * block_bytes + 4096)
    executor = chameleon.executor
    keep_everything = IterationContext(policy=_keep_everything_policy())  # swaps nothing: every tensor is kept
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        with chameleon.device.active(), executor.active(keep_everything) as counters:
            a = torch.sigmoid(w * 1.0)  # 1 block, saved by sigmoid and kept
            b = torch.sigmoid(torch.cat([w, w]) * 1.0)  # 2 blocks, saved and kept
            partial = a.sum() + b.sum()
            if write == "before":
                a.mul_(2)
                partial = partial + a.sum()
                del a  # only the saved alias holds a now: the passive swap takes it (best fit)
            else:
                del b  # b goes in the passive swap; a (held) is swapped too, first, as the best fit
            pressure = torch.ones(3, 256, 256)  # 1 block short
            assert counters.passive_swaps > 0
            if write == "after":
                a.mul_(2)
                partial = partial + a.sum()
                del a
            loss = partial + pressure.sum()
            del pressure
            chameleon.device.backend.allocator.capacity_bytes *= 4  # room for backward's temporaries
            loss.backward()


def _keep_everything_policy():
    from chameleon_dist.policy.model import Policy

    return Policy(name="keep-all", budget_bytes=0, feasible=True, predicted_peak_bytes=0, no_swap_peak_bytes=0,
                  predicted_stall_s=0.0, predicted_recompute_s=0.0, predicted_iteration_s=0.0, compute_s=0.0,
                  entries=[], layers=[], num_ops=0, trace_iteration=0, settings={})
