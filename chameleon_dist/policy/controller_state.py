"""What the ``PolicyController`` (``policy/selection.py``) holds, split by what it is about.

- ``TrialRound``: the current GenPolicy stage's candidates and trials, and what they asked for next;
- ``ChosenPolicy``: the policy Stable applies and what it may still do in place;
- ``SwapAllBaseline``: what swapping every eligible tensor measured, the baseline trials compete with;
- ``GenerationBasis``: what the latest generation worked from (its trace, ``min_swap_bytes``, growth);
- ``ProfiledIteration``: the stall and saved bytes of the iteration the next policies are built from;
- ``Learned``: how far under the budget the next policies aim, and the compute-time scale.

Each is plain state with the few updates that belong to it; the decisions stay in the controller and in
``policy.judgement``'s rules and ``policy.stable``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.outcome import IterationOutcome
from chameleon_dist.policy.tightening import MAX_IN_PLACE_TIGHTENINGS
from chameleon_dist.policy.trials import TrialResult
from chameleon_dist.trace.stages import Stage
from chameleon_dist.trace.step_trace import StepTrace

__all__ = ["ChosenPolicy", "GenerationBasis", "Learned", "NEAR_FLOOR_FACTOR", "ProfiledIteration", "SwapAllBaseline",
           "TrialRound"]

NEAR_FLOOR_FACTOR = 1.5
"""The capacity is near the floor when it is at most this many times the peak of swapping everything (there,
policies predicted to fit are often slightly short, and swapping everything is the next stricter choice)."""


@dataclasses.dataclass
class TrialRound:
    """The trials of the current GenPolicy stage: the policies to try, what each trial measured, and what
    the trials asked for next."""

    candidates: list[Policy] = dataclasses.field(default_factory=list)
    results: list[TrialResult] = dataclasses.field(default_factory=list)
    repeat: Policy | None = None  # the close pair's policy the next GenPolicy iteration tries again
    regenerate: bool = False  # trial feedback asks for new policies before the next trial
    need_policies: bool = False  # a GenPolicy stage began: generate before its first trial
    explore_bytes: int = 0  # how much further under the budget than the reserve, until the next GenPolicy stage

    def begin(self) -> None:
        """A new GenPolicy stage's first generation: no trials yet, nothing explored, nothing to repeat."""
        self.results, self.explore_bytes, self.repeat = [], 0, None


@dataclasses.dataclass
class ChosenPolicy:
    """The policy Stable applies (``chosen``; None: swap every eligible tensor), how many times one was
    chosen (``version``), and what it may still do without new trials."""

    chosen: Policy | None = None
    version: int = 0
    headroom_bytes: int = 0  # how much one policy's peak moved between its trials, when one was chosen
    scaled_for: float = 1.0  # the chosen policy is made for this many times the trace's saved bytes
    in_place_left: int = 0  # in-place tightenings the chosen policy may still take
    no_stricter_policy: bool = False  # the last in-place tightening found no policy predicted lower
    warmup_unsafe: bool = False  # the chosen policy needed passive swaps or a retry in WarmUp

    def choose(self, policy: Policy) -> None:
        """A new choice (from the trials or untried): a new version, made for the trace, every in-place
        tightening still allowed."""
        self.chosen = policy
        self.version += 1
        self.in_place_left = MAX_IN_PLACE_TIGHTENINGS
        self.scaled_for = 1.0

    def replace(self, policy: Policy | None) -> None:
        """The chosen policy replaced in place (scaled, tightened, swapping everything): a new version."""
        self.chosen = policy
        self.version += 1


@dataclasses.dataclass
class SwapAllBaseline:
    """What swapping every eligible tensor measured: the last resort the trials compete with, and the floor
    a policy cannot go below."""

    peak_bytes: int = 0  # peak of the latest WarmUp iteration that swapped everything
    iteration_s: float | None = None  # ... its time (any stage), since the latest WarmUp began
    held_alone: bool = False  # ... and it needed no passive swap

    def note(self, outcome: IterationOutcome) -> None:
        """An iteration that swapped everything (``outcome.policy`` None); others change nothing."""
        if outcome.policy is not None:
            return
        if not outcome.oom_retries:  # what the last resort measured, to compare trials with
            self.iteration_s = outcome.iteration_s
            if outcome.stage == Stage.WARMUP:
                self.peak_bytes = outcome.peak_device_bytes
        if outcome.stage == Stage.WARMUP:
            self.held_alone = not (outcome.oom_retries or outcome.passive_swaps)

    def forget_timing(self) -> None:
        """Back to WarmUp from another stage: what it measured was on another sequence."""
        self.iteration_s = None
        self.held_alone = False

    def fits_near_floor(self, capacity_bytes: int | None) -> bool:
        """The latest WarmUp iteration that swapped everything completed within the capacity (the floor
        fits), and the capacity is at most ``NEAR_FLOOR_FACTOR`` times its peak."""
        floor = self.peak_bytes
        return bool(floor) and capacity_bytes is not None and floor <= capacity_bytes <= NEAR_FLOOR_FACTOR * floor


@dataclasses.dataclass
class GenerationBasis:
    """What the latest generation worked from: its trace (compute-only times, grown to what the layers
    saved at most), ``min_swap_bytes``, and what it found the trace needs."""

    min_swap_bytes: int
    trace: StepTrace | None = None
    needed_bytes: int = 0  # no-swap peak - budget of the latest trace
    generated_for: float = 1.0  # the latest generation's trace was grown to this many times its saved bytes
    generation_s: float = 0.0  # how long the latest generation took


@dataclasses.dataclass
class ProfiledIteration:
    """The stall and saved bytes of the latest profiled iteration, each keyed by its iteration number: the
    iteration the next policies are built from."""

    stall_s: dict[int, float] = dataclasses.field(default_factory=dict)
    saved_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    saved_by_layer: dict[int, Mapping[int, int]] = dataclasses.field(default_factory=dict)

    def note(self, outcome: IterationOutcome) -> None:
        """``outcome``'s figures, when a detailed trace of its iteration was recorded."""
        if outcome.profiled:
            self.stall_s = {outcome.iteration: outcome.attempt_stall_s}
            self.saved_bytes = {outcome.iteration: outcome.saved_bytes}
            self.saved_by_layer = {outcome.iteration: outcome.saved_bytes_by_layer}


@dataclasses.dataclass
class Learned:
    """What the trials and the failures taught, kept across stages: how far under the budget the next
    policies aim (``reserve_bytes``; it grows when policies miss) and how the measured compute time
    compares with the trace's (``time_scale``)."""

    reserve_bytes: int = 0
    time_scale: float = 1.0
