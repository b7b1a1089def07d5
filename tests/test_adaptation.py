"""Adaptation under a memory budget: every sequence-change scenario of tests/test_scenarios.py, now on a
device smaller than its unswapped peak. Training stays bit-identical, nothing crashes, and the budget
holds again within ``warmup_iterations + policy_trials + 1`` iterations of the change.

``python -m tests.test_adaptation`` prints the table recorded in docs/sequence-changes.md.
"""

from __future__ import annotations

import functools

import pytest

from tests import scenario_models as sm
from tests.scenario_models import EVENT

ITERATIONS = 24
WARMUP, TRIALS = 2, 5  # the profiler's defaults
CAPACITY_FRACTION = 0.85  # device capacity, of the scenario's largest unswapped peak
# b's validation forward (batch 8, under no_grad, gradients live) needs ~95% of the training peak by itself:
# nothing in it is saved for backward, so no swap can lower it
CAPACITY_FRACTIONS = {"b": 0.99}
BUDGET_FRACTION = 0.95  # memory_budget, of the capacity: trials may go over it, never over the capacity
BUDGET_FRACTIONS = {"b": 1.0}  # (b: the validation pass's own peak is above 95% and is no saved activation)


def _budget_fraction(key: str) -> float:
    return BUDGET_FRACTIONS.get(key, BUDGET_FRACTION)


@functools.cache
def _unswapped_peak(key: str) -> int:
    result = sm.run(sm.SCENARIOS[key](), ITERATIONS, config={"enabled": False})
    return max(r.peak_device_bytes for r in result.reports)


@functools.cache
def _constrained(key: str) -> tuple[sm.Run, int]:
    capacity = int(_unswapped_peak(key) * CAPACITY_FRACTIONS.get(key, CAPACITY_FRACTION))
    config = {"memory_budget": _budget_fraction(key)}
    return sm.run(sm.SCENARIOS[key](), ITERATIONS, config=config, capacity_bytes=capacity), capacity


@functools.cache
def _plain(key: str) -> sm.Run:
    return sm.run(sm.SCENARIOS[key](), ITERATIONS, chameleon=False)


def held_again_after(result: sm.Run, budget: int) -> int | None:
    """Iterations after EVENT until the peak stays within the budget for good (0: it never left it)."""
    peaks = [r.peak_device_bytes for r in result.reports]
    for start in range(EVENT, ITERATIONS + 1):
        if all(p <= budget for p in peaks[start - 1:]):
            return start - EVENT
    return None


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with sm.one_thread():
        yield


QUICK_SCENARIO = "b"
"""The scenario the quick tier runs (the cheapest, 2.4 s loaded; the others are slow: the default tier runs all)."""


@pytest.mark.parametrize("key", [pytest.param(k, marks=() if k == QUICK_SCENARIO else pytest.mark.slow)
                                 for k in sm.SCENARIOS])
def test_bit_identical_and_the_budget_holds_again_soon_after_the_change(key):
    result, capacity = _constrained(key)
    sm.assert_bit_identical(result, _plain(key))
    assert max(r.peak_device_bytes for r in result.reports) <= capacity
    assert sum(r.swap_out_bytes for r in result.reports) > 0, "the capacity must force swapping"
    after = held_again_after(result, int(capacity * _budget_fraction(key)))
    assert after is not None and after <= WARMUP + TRIALS + 1, [r.peak_device_bytes for r in result.reports]
    assert result.reports[-1].stage == "stable"


def _table() -> None:
    print(f"capacity {CAPACITY_FRACTION:.0%} of the unswapped peak (b: {CAPACITY_FRACTIONS['b']:.0%}), memory budget "
          f"{BUDGET_FRACTION:.0%} of the capacity; event at iteration {EVENT}")
    print("| scenario | unswapped peak | capacity | peak with Chameleon | swapped MiB/it | stages from the event on | budget held again after |")
    print("|---|---|---|---|---|---|---|")
    for key in sm.SCENARIOS:
        result, capacity = _constrained(key)
        sm.assert_bit_identical(result, _plain(key))
        after = held_again_after(result, int(capacity * _budget_fraction(key)))
        stages = "".join(s[0].upper() for s in result.stages[EVENT - 1:])
        swapped = sum(r.swap_out_bytes for r in result.reports) / len(result.reports) / 2**20
        print(f"| {key} | {_unswapped_peak(key) / 2**20:.2f} MiB | {capacity / 2**20:.2f} MiB | "
              f"{max(r.peak_device_bytes for r in result.reports) / 2**20:.2f} MiB | {swapped:.2f} | {stages} | "
              f"{'never' if after is None else f'{after} iterations'} |")


if __name__ == "__main__":
    with sm.one_thread():
        _table()
