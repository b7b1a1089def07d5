"""An out-of-memory retry gives the attached modules' buffers back as the iteration began (NOTE [Buffers a retry
gives back] in chameleon_dist/retry_buffers.py): batch norm's running statistics, updated in place by an op whose
schema does not say so, and its ``num_batches_tracked``, updated by a declared ``add_``. Without it a retry
applies the momentum update twice and counts the batch twice: silently different statistics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice


class _FailOnce(nn.Module):
    """Raises an out-of-memory error the first ``failures`` times it runs (as an op that runs short would)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def forward(self, x):
        if self.failures:
            self.failures -= 1
            raise torch.OutOfMemoryError("injected: an op after batch norm ran out of memory")
        return x


def _model(failures: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), _FailOnce(failures), nn.GELU(), nn.Linear(64, 8))


def _state(model: nn.Sequential) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.buffers(), *(p.grad for p in model.parameters()))]


def _run(failures: int, chameleon: Chameleon | None, steps: int = 3) -> tuple[list[torch.Tensor], list]:
    model = _model(failures)
    reports = []
    if chameleon is not None:
        chameleon.attach(model)
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))

        def closure():
            loss = model(x).square().mean()
            loss.backward()
            return loss.detach()

        if chameleon is None:
            closure()
        else:
            chameleon.run_iteration(closure)
            reports.append(chameleon.last_report)
    return _state(model), reports


@pytest.mark.parametrize("failures", [1, 2])
def test_a_retried_iteration_leaves_batch_norms_statistics_as_a_plain_run(failures):
    reference, _ = _run(0, None)
    device = EmulatedDevice(10**9, host_op_s=1e-6)
    state, reports = _run(failures, Chameleon({"min_swap_bytes": 0, "executor": {"max_oom_retries": 3}}, device=device))
    assert reports[0].oom_retries == failures
    assert all(torch.equal(a, b) for a, b in zip(state, reference, strict=True))


def test_without_retries_nothing_is_kept():
    device = EmulatedDevice(10**9, host_op_s=1e-6)
    chameleon = Chameleon({"executor": {"max_oom_retries": 0}}, device=device)
    _run(0, chameleon, steps=1)
    assert device.dispatch.before_write is None
