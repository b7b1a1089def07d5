"""The executor's own refusals of a planned recomputation (NOTE [Per-tensor recompute] in
executor/recompute.py): a policy says RECOMPUTE (fuzzy matching can apply one planned on another iteration),
but what the executor sees at the save says the producer would not rebuild these bytes. The tensor is kept
instead, counted in ``recompute_unavailable``, and the gradients are those of a run without Chameleon."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.executor import IterationContext, SwapExecutor
from chameleon_dist.executor.recompute import ProducerLog
from chameleon_dist.policy.model import Decision
from tests.by_hand import Producers, policy_by_hand

KEY = "float32[64, 64]"


class _Unseen(torch.autograd.Function):
    """A fused kernel's Function: its result is an aten op's output that a kernel outside the dispatcher then
    changed (here: a write with every dispatch mode off, through ``.data`` so no version counter moves)."""

    @staticmethod
    def forward(ctx, x):
        out = x * 2
        with _disable_current_modes():
            out.data.add_(1.0)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def _written_seen(x):
    h = x * 2  # (saves nothing)
    h.add_(1.0)  # after its creation, before autograd saves it
    return h


def _written_unseen(x):
    h = x * 2
    with _disable_current_modes():  # a kernel the dispatch modes do not see; the version counter moves
        h.add_(1.0)
    return h


def _empty_then_copy(x):
    h = torch.empty_like(x)
    h.copy_(x * 3)
    return h


def _empty_then_unseen_copy(x):
    source = x * 3
    h = torch.empty_like(x)
    with _disable_current_modes():
        h.copy_(source)
    return h


class _Model(nn.Module):
    """``make(x)`` builds h; gelu saves h (the first saved storage: the policy recomputes it), sin saves
    gelu's result."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def forward(self, x):
        return torch.nn.functional.gelu(self.make(x)).sin().sum()


MAKERS = {"written_seen": _written_seen, "written_unseen": _written_unseen, "empty_then_copy": _empty_then_copy,
          "empty_then_unseen_copy": _empty_then_unseen_copy, "custom_function": _Unseen.apply}


def _x() -> torch.Tensor:
    return torch.linspace(-2, 2, 64 * 64).reshape(64, 64)


def _recomputing(model) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The input's gradient without Chameleon, and with a policy that recomputes the first saved storage,
    with that run's counters."""
    x = _x().requires_grad_()
    model(x).backward()
    reference = x.grad
    device = EmulatedDevice(10**9)
    executor = SwapExecutor(device, min_swap_bytes=0)
    x = device.track(_x()).requires_grad_()
    policy = policy_by_hand([Decision.RECOMPUTE, None], KEY)
    with device.active(), executor.active(IterationContext(policy=policy)) as counters, Producers(executor):
        model(x).backward()
    return reference, x.grad, counters


@pytest.mark.parametrize("how", list(MAKERS))
def test_a_storage_written_after_its_creation_is_kept_not_recomputed(how):
    reference, grad, counters = _recomputing(_Model(MAKERS[how]))
    assert counters.recompute_unavailable == 1
    assert counters.recomputed_storages == 0
    assert torch.equal(grad, reference)


def test_a_storage_not_written_is_still_recomputed():
    """The control: the same model without the write is rebuilt from its producer, bit for bit."""
    reference, grad, counters = _recomputing(_Model(lambda x: x * 2))
    assert counters.recompute_unavailable == 0 and counters.recomputed_storages == 1
    assert torch.equal(grad, reference)


def test_the_producer_log_asks_the_same_judge():
    """Ops a name check let through: atomics (bincount), uninitialised memory (empty), an input written in
    place after the op ran (unseen by the log: only its version counter says so)."""
    executor = SwapExecutor(EmulatedDevice(10**9), min_swap_bytes=0)
    log = ProducerLog(executor._attempt.holders.holder_of)
    ints = torch.tensor([1, 2, 2, 5])
    counts = torch.ops.aten.bincount.default(ints)
    log.note(torch.ops.aten.bincount.default, (ints,), {}, counts)
    assert log.recipe_for(counts, executor._pack_input) is None
    blank = torch.ops.aten.empty.memory_format([16])
    log.note(torch.ops.aten.empty.memory_format, ([16],), {}, blank)
    assert log.recipe_for(blank, executor._pack_input) is None

    a = torch.randn(8, 8)
    out = torch.ops.aten.exp.default(a)
    log.note(torch.ops.aten.exp.default, (a,), {}, out)
    assert log.recipe_for(out, executor._pack_input) is not None
    a.add_(1.0)  # not logged: a kernel outside the dispatcher
    assert log.recipe_for(out, executor._pack_input) is None
