"""What one ``generate_policies`` call works from: the ``PolicySettings`` (budget, link, host budget,
trials), the ``Variant`` trade-offs tried, and the ``Context`` every variant shares (the trace, its
logical layers and timing, the no-swap memory curve, the candidates). Both the generator and
``assemble`` read them; neither imports the other for them."""

from __future__ import annotations

import dataclasses

import numpy as np

from chameleon_dist.policy.candidates import Candidate
from chameleon_dist.policy.layers import LayerGroup
from chameleon_dist.policy.simulator import Planned, SimResult, simulate
from chameleon_dist.trace.step_trace import StepTrace

# what ``Policy.settings["margin"]`` records for the "all" variant, which has no margin (it aims at no target)
ALL_CANDIDATES_MARGIN = -1.0


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    budget_bytes: int
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    min_swap_bytes: int = 0
    host_budget_bytes: int | None = None
    score_c: float = 2.0  # Eq. 2's size weight
    trials: int = 5
    allow_recompute: bool = True
    ops_per_group: int = 64
    reserve_bytes: int = 0  # aim this far under the budget (the runtime raises it after a policy missed)
    prefetch_slack: float = 1.5  # swap-ins start this many copy-times of compute before the use, when possible

    def __post_init__(self) -> None:
        problems = []
        if self.budget_bytes <= 0:
            problems.append(f"memory_budget must be positive, got {self.budget_bytes} bytes")
        if self.d2h_bytes_per_s <= 0 or self.h2d_bytes_per_s <= 0:
            problems.append("device.d2h_bytes_per_s and device.h2d_bytes_per_s must be positive")
        if self.trials < 1:
            problems.append(f"profiler.policy_trials must be >= 1, got {self.trials}")
        if self.reserve_bytes < 0:
            problems.append(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if self.host_budget_bytes is not None and self.host_budget_bytes < 0:
            problems.append("host_memory_budget must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One trial's trade-off. Different variants give different policies from the same trace, and the
    controller keeps the fastest that holds."""

    name: str
    size_weight: float  # Eq. 2's C: how much a candidate's size counts against its coverage
    margin: float = 0.0  # aim this share of the needed reduction (no-swap peak - budget) further under the budget
    allow_recompute: bool = True
    take_every_candidate: bool = False  # the fallback: no selection, every candidate the host budget allows
    prefer_recompute: bool = False  # recompute every exactly recomputable candidate cheaper to rebuild than to copy

    @property
    def recorded_margin(self) -> float:
        return ALL_CANDIDATES_MARGIN if self.take_every_candidate else self.margin


def variants(settings: PolicySettings) -> list[Variant]:
    """The trials in the order they are tried; "all" (every candidate) is the fallback and comes last."""
    c, recompute = settings.score_c, settings.allow_recompute
    return [
        Variant("balanced", c, 0.0, recompute),
        Variant("margin5", c, 0.05, recompute),
        Variant("recompute-first", c, 0.0, recompute, prefer_recompute=True),
        Variant("coverage-first", c / 4, 0.0, recompute),
        Variant("size-first", c * 4, 0.0, recompute),
        Variant("swap-only-margin10" if recompute else "margin10", c, 0.10, allow_recompute=False),
        Variant("all", c, allow_recompute=False, take_every_candidate=True),
    ]


@dataclasses.dataclass
class Context:
    """What every variant of one ``generate_policies`` call shares: the trace, its logical layers and
    timing, the no-swap memory curve and the swap candidates."""

    trace: StepTrace
    settings: PolicySettings
    groups: list[LayerGroup]
    group_of: np.ndarray
    group_times_s: list[float]
    op_times_s: list[float]
    base_curve: list[int]
    candidates: list[Candidate]

    def simulate(self, planned: list[Planned]) -> SimResult:
        s = self.settings
        return simulate(self.base_curve, self.op_times_s, planned, s.d2h_bytes_per_s, s.h2d_bytes_per_s)
