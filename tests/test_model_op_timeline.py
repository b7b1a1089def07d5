"""The main job's memory curve: one sample per op of the model, so runs with and without swapping align."""

import pytest
import torch

from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.cli.timeline import ModelOpTimeline, sampling
from tests.models import lm_batch, lm_loss, make_lm
from tests.scenario_models import one_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _curve(enabled: bool) -> tuple[list[int], int]:
    """Iteration 2 (after Adam created its state) sampled per model op; and the device's peak in it."""
    model = make_lm(0)
    device = EmulatedDevice(capacity_bytes=10**9, h2d_bytes_per_s=None, d2h_bytes_per_s=None)
    runtime = Chameleon({"enabled": enabled, "min_swap_bytes": 0}, device=device)
    runtime.attach(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens, labels = lm_batch(0)
    closure = lambda: lm_loss(model, tokens, labels).backward()  # noqa: E731
    runtime.run_iteration(closure, optimizer=optimizer)
    optimizer.zero_grad(set_to_none=True)
    timeline = ModelOpTimeline(device.live_bytes, runtime.profiler.scope)
    with sampling(timeline, closure, optimizer) as (sampled_closure, sampled_optimizer):
        runtime.run_iteration(sampled_closure, optimizer=sampled_optimizer)
    assert "step" not in vars(optimizer), "the optimizer gets its own step back"
    if enabled:
        assert runtime.last_report.swap_out_bytes > 0
    return timeline.samples_bytes, runtime.last_report.peak_device_bytes


def test_curves_with_and_without_swapping_have_one_point_per_model_op():
    swapped, swapped_peak_bytes = _curve(enabled=True)
    plain, plain_peak_bytes = _curve(enabled=False)
    assert len(swapped) == len(plain) > 0, "the runtime's copies, restores and hook detaches are not points"
    assert max(plain) == plain_peak_bytes and max(swapped) <= swapped_peak_bytes
    assert max(swapped) < max(plain)
