"""Per-tensor recomputation in the runtime (NOTE [Per-tensor recompute] in executor/recompute.py): RECOMPUTE
decisions are carried out bit-identically on a model full of GELU, SwiGLU and norms, swap and recompute
mix in one policy, ``executor.allow_recompute: false`` forbids it, and where the host link is too slow for
swapping alone, swap + recompute meets the budget."""

from __future__ import annotations

import pytest
import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.policy.generator import generate_policies
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.model import Decision, Infeasibility
from launch.models.swiglu_lm import SwiGLULM
from tests.models import train_next_token

VOCAB, HIDDEN, LAYERS, BATCH, SEQ = 64, 64, 3, 2, 64
STEPS = 8


def Model() -> SwiGLULM:
    return SwiGLULM(VOCAB, HIDDEN, LAYERS)


def _train(chameleon: Chameleon, steps: int = STEPS, after_step=None):
    torch.manual_seed(0)
    model = chameleon.attach(Model())
    return train_next_token(chameleon, model, steps, VOCAB, BATCH, SEQ, after_step)


@pytest.fixture(scope="module")
def reference():
    probe = Chameleon({"enabled": False}, device=EmulatedDevice(10**11))
    losses, params = _train(probe)
    # a detailed trace with the saves recorded (the executor reports them; instant link, nothing to wait for)
    tracer = Chameleon({"profiler": {"warmup_iterations": 1}}, device=EmulatedDevice(10**11))
    _train(tracer, steps=1)
    return probe.last_report.peak_device_bytes, probe.last_report.iteration_s, losses, params, tracer.last_trace


def _slow_link_config(peak_bytes: int, iteration_s: float, allow_recompute: bool, share: float = 0.85) -> tuple:
    """A budget that needs a fair share of the activations off the device, and a link that moves a few
    percent of the peak per iteration: swapping alone cannot keep up."""
    rate = peak_bytes / iteration_s / 40
    device = EmulatedDevice(int(peak_bytes * share), h2d_bytes_per_s=rate, d2h_bytes_per_s=rate)
    config = {"memory_budget": int(peak_bytes * share), "min_swap_bytes": 4096,
              "profiler": {"warmup_iterations": 1, "policy_trials": 3},
              "executor": {"allow_recompute": allow_recompute}}
    return config, device


def test_recompute_runs_bit_identically_and_mixes_with_swap(reference):
    peak_bytes, iteration_s, ref_losses, ref_params, _ = reference
    # 70%: enough must leave the device that the slow link alone cannot carry it (a budget that needs
    # less can be met by recomputing alone, and which one the policy picks then depends on timing)
    config, device = _slow_link_config(peak_bytes, iteration_s, allow_recompute=True, share=0.7)
    chameleon = Chameleon(config, device=device)
    recomputed = []

    def note(ch: Chameleon) -> None:
        recomputed.append((ch.last_report.recomputed_bytes, ch.last_report.swap_out_bytes))

    losses, params = _train(chameleon, after_step=note)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    assert max(r for r, _ in recomputed) > 0, "no tensor was recomputed"
    assert any(r > 0 and s > 0 for r, s in recomputed), "no iteration both swapped and recomputed"
    assert chameleon.last_report.recompute_unavailable == 0


def test_allow_recompute_false_forbids_it(reference):
    peak_bytes, iteration_s, ref_losses, ref_params, _ = reference
    config, device = _slow_link_config(peak_bytes, iteration_s, allow_recompute=False)
    chameleon = Chameleon(config, device=device)
    recomputed = []
    losses, params = _train(chameleon, after_step=lambda ch: recomputed.append(ch.last_report.recomputed_bytes))
    assert recomputed == [0] * STEPS
    assert all(not any(e.decision == Decision.RECOMPUTE for e in p.entries) for p in chameleon.controller.candidates)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))


def test_link_bound_budget_needs_recompute(reference):
    """Swap-only policies are predicted short because the link is too slow; swap + recompute fits, and is
    predicted faster than recomputing whole layers (the forward pass of every layer once more)."""
    peak_bytes, iteration_s, _, _, trace = reference
    rate = peak_bytes / iteration_s / 40
    settings = dict(budget_bytes=int(peak_bytes * 0.85), d2h_bytes_per_s=rate, h2d_bytes_per_s=rate, min_swap_bytes=4096)
    swap_only = generate_policies(trace, PolicySettings(**settings, allow_recompute=False))
    assert not swap_only.feasible
    assert swap_only.best.infeasibility == Infeasibility.LINK_TOO_SLOW
    mixed = generate_policies(trace, PolicySettings(**settings, allow_recompute=True))
    assert mixed.feasible, mixed.best.summary()
    best = mixed.best
    assert best.saved_bytes(Decision.RECOMPUTE) > 0
    forward_s = sum(t for layer, t in trace.layer_times_s.items() if layer >= 0)
    assert best.predicted_iteration_s < best.compute_s + forward_s


def test_input_changed_in_place_after_the_save_raises():
    """A recomputed tensor's producer input written in place after the save: recomputing would give other
    bytes, so unpacking raises (as autograd would for a saved input), never a silently wrong gradient."""
    from chameleon_dist.executor import SwapExecutor
    from chameleon_dist.executor.recompute import ProducerLog

    device = EmulatedDevice(10**9)
    executor = SwapExecutor(device, min_swap_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    log = ProducerLog(executor._attempt.holders.holder_of)
    with device.active():
        h = x * 2  # not a leaf: its storage is an activation
        device.track(h)
        y = torch.nn.functional.gelu(h)
        log.note(torch.ops.aten.gelu.default, (h,), {}, y)
        recipe = log.recipe_for(y, executor._pack_input)
        assert recipe is not None
        h.add_(1.0)  # after the save
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            recipe.run(executor._unpack_in_hidden_scope)


def test_a_producer_whose_result_object_died_is_still_found():
    """``matmul`` returns ``mm``'s result through ``_unsafe_view``: the ``mm`` result object dies at once while
    its storage lives on. The producer is found by the storage it made, and rebuilds the same bytes."""
    from chameleon_dist.device.base import byte_view
    from chameleon_dist.executor import SwapExecutor
    from chameleon_dist.executor.recompute import ProducerLog

    executor = SwapExecutor(EmulatedDevice(10**9), min_swap_bytes=0)
    log = ProducerLog(executor._attempt.holders.holder_of)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    out = torch.ops.aten.mm.default(a, b)
    log.note(torch.ops.aten.mm.default, (a, b), {}, out)
    view = torch.ops.aten._unsafe_view.default(out, [64])
    log.note(torch.ops.aten._unsafe_view.default, (out, [64]), {}, view)
    del out
    recipe = log.recipe_for(view, executor._pack_input)
    assert recipe is not None
    assert torch.equal(recipe.run(executor._unpack_in_hidden_scope), byte_view(view.untyped_storage()))
