"""Policies for the chosen one's place without trials: stricter after a Stable peak over the budget, or made
for a larger shape than the traced one (``PolicyController`` in ``policy/selection.py`` decides when).

Trials cost iterations (and a return to WarmUp costs swap-everything iterations), so a Stable policy that
went a little over, or met a longer sequence, is replaced by one generated from the trace the controller
already has, applied at once. These are the searches; the controller keeps the counts and the choice.
"""

from __future__ import annotations

import dataclasses

from chameleon_dist.policy.generator import generate_policies
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.scaling import grown
from chameleon_dist.trace.step_trace import StepTrace

MAX_IN_PLACE_TIGHTENINGS = 3
"""Stable peaks over the budget (within the capacity) absorbed by tightening the chosen policy in place;
the next one sends the runtime back to WarmUp. The k-th adds 2**(k-1) times its shortfall to the reduction
the policy aims for (a policy that missed again needs more than its last miss), and doubles that step up
to ``STRICTER_SEARCH_STEPS`` times until a policy predicted lower than the one that went over comes out."""

STRICTER_SEARCH_STEPS = 6

GROWTH_TOLERANCE = 0.05
"""Saved bytes this much (relative) above what the chosen policy was made for make an iteration a new,
larger shape, which is scaled for before the runtime profiles again."""


def policies_for(trace: StepTrace, growth: float, settings: PolicySettings) -> list[Policy]:
    """Policies, without trials, from ``trace`` grown ``growth`` times (``policy.scaling.grown``)."""
    return generate_policies(grown(trace, growth), settings).policies


def stricter_than(policy: Policy, trace: StepTrace, growth: float, settings: PolicySettings,
                  step_bytes: int) -> tuple[list[Policy], int]:
    """Policies predicted lower than ``policy``: ``settings.reserve_bytes`` raised by ``step_bytes``, the
    step doubled (up to ``STRICTER_SEARCH_STEPS`` times, the reserve at most the budget) until some come
    out. Returns them (none when no reserve gave any) and the reserve they were generated with."""
    reserve_bytes, stricter = settings.reserve_bytes, []
    for _ in range(STRICTER_SEARCH_STEPS):
        reserve_bytes = min(settings.budget_bytes, reserve_bytes + step_bytes)
        policies = policies_for(trace, growth, dataclasses.replace(settings, reserve_bytes=reserve_bytes))
        stricter = [p for p in policies if p.predicted_peak_bytes < policy.predicted_peak_bytes]
        if stricter or reserve_bytes >= settings.budget_bytes:
            break
        step_bytes *= 2
    return stricter, reserve_bytes
