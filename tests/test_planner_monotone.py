"""Monotone by construction (issue 29, item 4): more device memory or a faster host link never gives a slower
best plan, a larger swap stall or an infeasible swap estimate for the same layout. Steps of 0.5 GB and 5%,
compared with ``<=`` on the floats themselves (no tolerance)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from chameleon_dist.planner.layout import Layout
from chameleon_dist.planner.profiles import HardwareProfile, load_hardware, load_model, make_setup
from chameleon_dist.planner.search import evaluate, search
from chameleon_dist.planner.space import SearchSpace
from chameleon_dist.planner import swap_prefix
from chameleon_dist.planner.swap_model import build_stage_trace, storage_parts
from chameleon_dist.planner.memory import head_activations, layer_activations, rank_peaks
from chameleon_dist.planner.timing import stage_timing

GB = 10**9
HALF_GB = GB // 2
STEP = 1.05

# layouts that really swap: (model, hardware, seq, layout, link bytes/s, device memory GB from, to)
SWAP_CASES = {
    "7b-pp2-vpp4-8k": ("llama2-7b", "ascend-910b", 8192, Layout(tp=1, pp=2, dp=4, vpp=4, swap=True), 10e9, 60, 76),
    "7b-tp2-16k": ("llama2-7b", "ascend-910b", 16384, Layout(tp=2, pp=1, dp=4, swap=True), 6e9, 63, 73),
    "70b-tp8-pp4-vpp2-8k": ("llama2-70b", "h100-80gb", 8192, Layout(tp=8, pp=4, dp=1, vpp=2, swap=True), 12e9, 64, 76),
}

SWAP_PARAMS = [pytest.param(c, marks=pytest.mark.slow) if c.startswith("70b") else c for c in SWAP_CASES]
"""(the 70b case, 3-5 s loaded a test, is out of the quick tier; the 7b ones stay)"""


def _hardware(name: str, link: float, memory_bytes: int | None = None) -> HardwareProfile:
    base = load_hardware(name)
    update = {"h2d_bytes_per_s": link, "d2h_bytes_per_s": link}
    if memory_bytes is not None:
        update["memory_bytes"] = memory_bytes
    return base.model_copy(update=update)


def _stall_or_inf(plan) -> float:
    return plan.time.stall if plan.feasible else float("inf")


def _assert_never_worse(stalls: list[float], feasible: list[bool]) -> None:
    assert all(later <= earlier for earlier, later in zip(stalls, stalls[1:])), stalls
    assert all(later or not earlier for earlier, later in zip(feasible, feasible[1:])), feasible


@pytest.mark.parametrize("case", SWAP_PARAMS)
def test_more_device_memory_never_raises_the_swap_stall(case):
    model, hardware, seq, layout, link, low_gb, high_gb = SWAP_CASES[case]
    model, setup = load_model(model), make_setup(global_batch_size=64, seq_length=seq)
    plans = [evaluate(model, _hardware(hardware, link, memory), setup, layout)
             for memory in range(low_gb * GB, high_gb * GB + 1, HALF_GB)]
    stalls, feasible = [_stall_or_inf(p) for p in plans], [p.feasible for p in plans]
    _assert_never_worse(stalls, feasible)
    # the range really goes from infeasible through swapping with a stall to needing no swap
    assert not feasible[0] and feasible[-1]
    assert any(p.feasible and p.swapped_bytes > 0 and p.time.stall > 0 for p in plans)
    assert plans[-1].swapped_bytes == 0 and plans[-1].time.stall == 0.0


@pytest.mark.parametrize("case", SWAP_PARAMS)
def test_a_faster_host_link_never_raises_the_swap_stall(case):
    model, hardware, seq, layout, link, low_gb, high_gb = SWAP_CASES[case]
    model, setup = load_model(model), make_setup(global_batch_size=64, seq_length=seq)
    memory = (low_gb + high_gb) // 2 * GB
    rates = [link * 0.5 * STEP**i for i in range(40)]  # 0.5x to ~3.5x
    plans = [evaluate(model, _hardware(hardware, rate, memory), setup, layout) for rate in rates]
    stalls, feasible = [_stall_or_inf(p) for p in plans], [p.feasible for p in plans]
    _assert_never_worse(stalls, feasible)
    assert stalls[0] > stalls[-1]  # the sweep sees the stall change
    assert feasible[-1] and all(p.swapped_bytes > 0 for p in plans if p.feasible)


# (model, hardware, seq, devices, space, memory GB from, to, link bytes/s; the link sweep's memory GB, first rate)
SEARCH_CASES = {
    "7b-on-8-ascend-8k": ("llama2-7b", "ascend-910b", 8192, 8, SearchSpace(), 40, 50, 23e9, 60, 11.5e9),
    "70b-on-32-h100-8k": ("llama2-70b", "h100-80gb", 8192, 32,
                          SearchSpace(micro_batch=(1,), vpp=(2,), recompute=("none", "full")),
                          61, 65, 12e9, 72, 30e9),
}


def _best_times(model, setup, devices, space, hardware_list) -> list[float]:
    best = [search(model, hardware, setup, devices, space).best for hardware in hardware_list]
    return [p.iteration_s if p is not None else float("inf") for p in best]


@pytest.mark.parametrize("case", list(SEARCH_CASES))
@pytest.mark.slow  # (out of the quick tier: a search per memory size, 14-23 s loaded a case)
def test_the_best_plan_never_slows_with_more_memory(case):
    model, hardware, seq, devices, space, low_gb, high_gb, link, _, _ = SEARCH_CASES[case]
    model, setup = load_model(model), make_setup(global_batch_size=64, seq_length=seq)
    times = _best_times(model, setup, devices, space, [_hardware(hardware, link, memory)
                                                       for memory in range(low_gb * GB, high_gb * GB + 1, HALF_GB)])
    assert all(later <= earlier for earlier, later in zip(times, times[1:])), times
    assert times[0] > times[-1]


@pytest.mark.parametrize("case", list(SEARCH_CASES))
@pytest.mark.slow  # (out of the quick tier: a search per link rate, 10 s loaded a case)
def test_the_best_plan_never_slows_with_a_faster_link(case):
    model, hardware, seq, devices, space, _, _, _, memory_gb, slow = SEARCH_CASES[case]
    model, setup = load_model(model), make_setup(global_batch_size=64, seq_length=seq)
    memory = memory_gb * GB
    times = _best_times(model, setup, devices, space, [_hardware(hardware, slow * STEP**i, memory) for i in range(17)])
    assert all(later <= earlier for earlier, later in zip(times, times[1:])), times
    assert times[0] > times[-1]


# ---- the replay's own properties, which the argument in planner/swap_prefix.py rests on --------------------
def _replay_inputs():
    model, setup = load_model("llama2-7b"), make_setup(global_batch_size=64, seq_length=8192)
    layout = Layout(tp=1, pp=2, dp=4, vpp=4, swap=True)
    hardware = load_hardware("ascend-910b")
    memory = rank_peaks(model, setup, layout)[0]
    acts = layer_activations(model, setup, layout.tp, layout.micro_batch, layout.recompute)
    trace, times = build_stage_trace(memory, stage_timing(model, hardware, setup, layout), layout, 12, False,
                                     storage_parts(acts.tensors), storage_parts(head_activations(model, setup, 1, 1)))
    return swap_prefix._inputs(trace, times, 0)


def test_the_replay_never_gets_worse_with_fewer_or_faster_copies():
    orders, units = _replay_inputs()
    data = orders[0]  # the replay does not depend on the order (only the prefixes do)
    rng = random.Random(29)
    everything = np.arange(len(data.nbytes))
    for lead in swap_prefix.LEADS_OPS:
        swap_in = swap_prefix._swap_in_ops(data, lead)
        for _ in range(20):
            larger = np.array(sorted(rng.sample(range(len(everything)), rng.randrange(1, len(everything)))))
            smaller = np.array(sorted(rng.sample(list(larger), rng.randrange(0, len(larger) + 1))), dtype=np.int64)
            rate = rng.uniform(2e9, 60e9)
            assert swap_prefix._stall(data, smaller, swap_in, rate) <= swap_prefix._stall(data, larger, swap_in, rate)
            faster_stall = swap_prefix._stall(data, larger, swap_in, rate * STEP)
            assert faster_stall <= swap_prefix._stall(data, larger, swap_in, rate)
            faster_peak = swap_prefix._peak(data, larger, swap_in, rate * STEP)[0]
            assert faster_peak <= swap_prefix._peak(data, larger, swap_in, rate)[0]
            assert swap_prefix._host_peak(data, smaller, swap_in) <= swap_prefix._host_peak(data, larger, swap_in)
            assert swap_prefix._instant_peak(data, larger, swap_in) <= swap_prefix._peak(data, larger, swap_in, rate)[0]


@pytest.mark.parametrize("order", [0, 1], ids=["longest-window-first", "shortest-window-first"])
def test_a_larger_budget_swaps_a_subset(order):
    orders, units = _replay_inputs()
    data = orders[order]
    peak = int(data.base.max())
    previous = None
    for budget in range(peak - 20 * GB, peak + HALF_GB, HALF_GB):
        fit = swap_prefix._shortest_fit(data, units, 1, budget, None, 10e9)
        if previous is not None and previous.k >= 0:
            assert 0 <= fit.k <= previous.k
        previous = fit
    assert previous.k == 0
