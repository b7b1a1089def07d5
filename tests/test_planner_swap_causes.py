"""Why a swap plan does not fit: the search picks its words from the typed cause (``SwapEstimate.
infeasibility``), never from the policy's message. Each case below is a tiny CPU GPT with a usable memory
chosen to hit one cause; the plan reasons were recorded when the search still matched on the message text,
so they pin that the typed branch selects exactly the same cases."""

import pytest

from chameleon_dist.planner import Layout, SearchSpace, search
from chameleon_dist.planner.calibrate import calibrated_hardware, cpu_setup, megatron_cpu_gpt
from chameleon_dist.planner.memory import stage_memory
from chameleon_dist.planner.search import why_swap_failed
from chameleon_dist.planner.swap_model import StageInfeasibility, SwapEstimate
from chameleon_dist.policy.model import Infeasibility

MICRO_BATCH = 2


def _search(layers: int, vocab: int, budget_fraction: float, host_memory_bytes: int | None = None):
    """A one-device search of the swap layout alone, with usable memory ``budget_fraction`` of the way from
    what swapping can never move (model state, workspace, one op's transients) to the no-swap peak."""
    model = megatron_cpu_gpt(layers, 256, 4, vocab, 256)
    setup = cpu_setup(MICRO_BATCH, 256)
    memory = stage_memory(model, setup, Layout(micro_batch=MICRO_BATCH), 0)
    floor = memory.static_bytes + max(memory.forward_extra_bytes, memory.backward_extra_bytes)
    usable = int(floor + budget_fraction * (memory.peak_bytes - floor))
    hardware = calibrated_hardware(model, setup, MICRO_BATCH, 1e-3, 1e-3, 1e9, usable_bytes=usable)
    if host_memory_bytes is not None:
        hardware = hardware.model_copy(update={"host_memory_bytes": host_memory_bytes})
    space = SearchSpace(vpp=(1,), micro_batch=(MICRO_BATCH,), recompute=("none",), swap=(True,))
    return search(model, hardware, setup, 1, space)


def _by_message(estimate: SwapEstimate) -> str:
    """The search's words as they were chosen from the message text before the typed cause existed."""
    if "host_memory_budget" in estimate.reason:
        return "the host memory budget runs out"
    if "no swappable" in estimate.reason or estimate.micro_batches_simulated == 0:
        return "the peak is where nothing can be swapped"
    return "copies cannot keep up with compute"


HOST = "the host memory budget runs out"
NOTHING = "the peak is where nothing can be swapped"
COPIES = "copies cannot keep up with compute"
CASES = {  # cause: (search arguments, the cause, the plan's reason as recorded)
    "host budget": ((4, 1000, 0.9, 2 * 10**6), Infeasibility.HOST_BUDGET, f"0.1 GB > 0.1 GB allowed ({HOST})"),
    "host budget, little kept": ((4, 1000, 0.9, 2 * 10**7), Infeasibility.HOST_BUDGET,
                                 f"0.1 GB > 0.1 GB allowed ({HOST})"),
    "link too slow": ((4, 1000, 0.9), Infeasibility.LINK_TOO_SLOW, f"0.1 GB > 0.1 GB allowed ({COPIES})"),
    "swap floor": ((4, 1000, 0.3), Infeasibility.SWAP_FLOOR_ABOVE_BUDGET, f"0.1 GB > 0.1 GB allowed ({COPIES})"),
    "no swappable": ((1, 100, 0.5), Infeasibility.NO_SWAPPABLE_AT_PEAK, f"0.0 GB > 0.0 GB allowed ({NOTHING})"),
    "static": ((4, 1000, 0.0), StageInfeasibility.STATIC_ABOVE_DEVICE, f"0.1 GB > 0.0 GB allowed ({NOTHING})"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_swap_failure_reason_is_as_recorded(case):
    args, _, tail = CASES[case]
    (plan,) = _search(*args).plans
    assert plan.reason == f"out of memory even with swap: stage 0 peaks at {tail}"


@pytest.mark.parametrize("case", list(CASES))
def test_typed_cause_selects_what_the_message_selected(case):
    args, cause, _ = CASES[case]
    (plan,) = _search(*args).plans
    (estimate,) = plan.swap
    assert estimate.infeasibility == cause
    assert why_swap_failed(estimate) == _by_message(estimate)


def test_a_fitting_estimate_on_an_out_of_memory_plan_reads_as_copies():
    fits = SwapEstimate(0, True, 0.0, 1, 1, 0, 1)
    assert fits.infeasibility is None and why_swap_failed(fits) == _by_message(fits) == COPIES


def test_plan_json_keeps_the_swap_estimate_without_the_typed_cause():
    (plan,) = _search(4, 1000, 0.9, 2 * 10**6).plans
    (entry,) = plan.to_dict()["swap"]
    assert "infeasibility" not in entry and "host_memory_budget" in entry["reason"]
