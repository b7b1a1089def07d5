"""Policies that expect routing and lengths to vary (issue 27, item 1): ``policy.variance`` learns what each
layer saved at most in the recent iterations, and the controller generates its policies from the trace grown
to that (``policy.scaling.grown`` per layer)."""

from pathlib import Path

import pytest

from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.scaling import grown
from chameleon_dist.policy.selection import IterationOutcome, PolicyController
from chameleon_dist.policy.variance import SavedBytesSpread
from chameleon_dist.trace.stages import Stage, Transition, TransitionCause
from chameleon_dist.trace.step_trace import StepTrace

MIB = 2**20
DATA = Path(__file__).resolve().parent / "data"


def test_the_spread_is_the_most_each_layer_saved_over_the_trace_and_small_moves_are_not_shapes():
    spread = SavedBytesSpread(window=3)
    assert spread.worst_case({0: 100, 1: 100}) == ({}, 1.0), "nothing seen"
    for seen in ({0: 100, 1: 90}, {0: 103, 1: 150}, {0: 100, 1: 120}):
        spread.note(seen)
    growth, total = spread.worst_case({0: 100, 1: 100, -1: 10})
    assert growth == {0: 1.0, 1: 1.5, -1: 1.0}, "layer 0 moved 3%: not a shape; layer 1 saved 1.5x"
    assert total == pytest.approx(253 / 210), "the most one iteration saved in all, over the trace's total"
    spread.note({0: 100, 1: 100})  # the window forgets the oldest
    spread.note({0: 100, 1: 100})
    assert spread.worst_case({0: 100, 1: 100})[0] == {0: 1.0, 1: 1.2}
    spread.clear()
    assert len(spread) == 0 and spread.worst_case({0: 100})[0] == {}


def test_the_total_grows_with_what_an_iteration_saved_in_all():
    spread = SavedBytesSpread()
    spread.note({0: 200, 1: 200})
    growth, total = spread.worst_case({0: 100, 1: 100})
    assert growth == {0: 2.0, 1: 2.0} and total == 2.0


def test_a_trace_grown_per_layer_grows_only_the_storages_its_layers_created():
    trace = StepTrace.load(DATA / "job_trace.json")
    layers = sorted({op.layer for op in trace.ops if op.layer >= 0})
    assert len(layers) >= 2
    varying = layers[0]
    by_layer = {layer: 1.0 for layer in layers} | {varying: 2.0}
    bigger = grown(trace, 1.0, by_layer)
    grew = 0
    for before, after in zip(trace.storages, bigger.storages):
        if before.is_parameter or before.created_at < 0 or before.freed_at < 0:
            assert after.nbytes == before.nbytes
        elif trace.ops[before.created_at].layer == varying:
            assert after.nbytes == 2 * before.nbytes
            grew += before.nbytes > 0
        elif trace.ops[before.created_at].layer in by_layer:
            assert after.nbytes == before.nbytes
    assert grew > 0
    assert max(bigger.no_swap_memory_curve()) > max(trace.no_swap_memory_curve())
    assert bigger.layer_times_s[varying] == 2 * trace.layer_times_s[varying]
    assert bigger.iteration_s > trace.iteration_s


def test_the_controller_generates_for_the_largest_shape_it_saw_not_only_the_traced_one():
    """An iteration before the traced one saved 1.5x in every layer (a longer sequence that recurs): the
    policies are made for that, before it comes back."""
    trace = StepTrace.load(DATA / "job_trace.json")
    traced = {op.layer: 10 * MIB for op in trace.ops}

    def generated(earlier: dict[int, int]) -> PolicyController:
        settings = PolicySettings(budget_bytes=80 * MIB, d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, min_swap_bytes=MIB)
        controller = PolicyController(settings, capacity_bytes=90 * MIB)
        for iteration, by_layer, profiled in ((trace.iteration - 1, earlier, False), (trace.iteration, traced, True)):
            outcome = IterationOutcome(iteration=iteration, stage=Stage.WARMUP, policy=None, peak_device_bytes=80 * MIB,
                                       iteration_s=trace.iteration_s, stall_s=0.0, attempt_stall_s=0.0,
                                       oom_retries=0, profiled=profiled,
                                       saved_bytes=sum(by_layer.values()), saved_bytes_by_layer=by_layer)
            controller.record(outcome)
        controller.follow(Transition(Stage.WARMUP, Stage.GEN_POLICY, TransitionCause.PROFILED, ""), outcome)
        assert controller.policy_for(Stage.GEN_POLICY, trace, MIB) is not None
        return controller

    same = generated(traced)
    longer = generated({layer: int(1.5 * b) for layer, b in traced.items()})
    expected = max(grown(trace, 1.5, {layer: 1.5 for layer in traced}).no_swap_memory_curve())
    assert same.candidates[0].no_swap_peak_bytes == max(trace.no_swap_memory_curve())
    assert longer.candidates[0].no_swap_peak_bytes == expected > same.candidates[0].no_swap_peak_bytes
